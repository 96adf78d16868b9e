import os

# Tests run servers and engine threads beside each other on few cores: OpenMP threads that spin while
# waiting would starve the others (a several-fold slowdown measured on 2 cores). Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture
def float_activations(monkeypatch):
    """Quantized linears with x as it is: without it, avx2_linear rounds x to int8 per block of 32 (as
    llama.cpp does), so that float32 logits are the dequantized weights' only to that rounding. For tests
    that compare a quantized model's float32 logits or greedy text with its dequantized weights' exactly."""
    from infer.quant import linear as quant_linear

    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", False)
