"""The models: the image zoo (`zoo`: an MLP, LeNet-5, ResNet-8), the GPT (`gpt`) and what it is
built from (`block`: the pre-norm residual block, `attention`: attention read from the packed qkv
projection, `moe`: the mixture-of-experts layer), and the GPT's weights in nanoGPT's names
(`nanogpt`)."""
