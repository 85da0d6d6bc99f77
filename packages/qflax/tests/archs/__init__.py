"""The model zoo: architectures written here, each at a tiny default size.

One module per architecture, each with a frozen ``Config`` (``d_model`` and ``layers``
set the size, e.g. ``Config(d_model=512, layers=4)`` for the benchmarks):

- :mod:`archs.decoder_lm`: Linen decoder LM, tied embeddings, ``nn.scan`` over
  ``nn.remat`` blocks of ``nn.MultiHeadDotProductAttention(decode=True)``.
- :mod:`archs.tiny_lm`: a one-block decoder with the ``decode=True`` cache and a
  sampler written for it (``config``, ``init_cache``, ``clone``).
- :mod:`archs.gemma_like`: Gemma-like decoder in NNX (KV cache) and its Linen twin.
- :mod:`archs.vit`: big_vision-style ViT (``nn.scan`` over ``nn.remat``, MAP head).
- :mod:`archs.resnet`: ResNet with BatchNorm, residual blocks, strided convolutions.
- :mod:`archs.moe`: mixture-of-experts layer on ``jax.lax.ragged_dot`` (top-1/top-2).
- :mod:`archs.gru`: GRU via ``nn.RNN(nn.GRUCell)``.
- :mod:`archs.nnx_scan`: NNX blocks made by ``nnx.vmap`` and run by ``nnx.scan``.
- :mod:`archs.loop_decoder`: recurrent decoder run by ``lax.fori_loop`` and a jitted
  ``lax.while_loop`` greedy ``generate``.
- :mod:`archs.small`: small models covering the ways Flax code calls the ops.
"""
