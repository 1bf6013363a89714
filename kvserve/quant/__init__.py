"""Weight-only quantisation of the projections (``--quantization int8|int4``).

- :mod:`formats`: quantised weights as codes + scales in ``[out, in]`` row order
  (what the loader fuses and permutes), quantisers from float, float64 dequantisers.
- :mod:`gguf_blocks`: llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks read straight into those forms.
- :mod:`kernels`: the device's packed layout and the PyTorch kernel that multiplies by it.
- :mod:`transform`: the load-time pass that swaps each decoder projection's float
  weight for a kernel (beside ``Projection.pack``).
"""
