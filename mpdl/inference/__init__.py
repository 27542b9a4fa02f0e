"""Inference: a trained GPT generating text (`generation`), its decoder with a KV cache over
tensor- and pipeline-parallel ranks (`inference`, `serving`), the paged KV cache (`paged`), the
continuous-batching engine (`engine`) and the HTTP server of `mpdl serve` (`server`)."""
