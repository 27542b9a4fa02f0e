"""The models: the image zoo (`zoo`: an MLP, LeNet-5, ResNet-8), the GPT (`gpt`), and the GPT's
weights in nanoGPT's names (`nanogpt`)."""
