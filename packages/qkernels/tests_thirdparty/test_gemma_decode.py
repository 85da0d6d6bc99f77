"""Gemma's own Transformer decoding one token per call: qkernels gives the XLA path's bits.

Third-party model code (the ``gemma`` package's ``gm.nn.Transformer``, random weights,
a tiny config, its KV cache), quantized with qflax (weight-only int8, int4, nf4, and
w8a8) and decoded at batch 1 — the case qkernels covers — once with the native
kernels and once with
``QCORE_NATIVE_KERNELS=0``. Each run is its own process: gemma's methods are wrapped
in ``nn.jit``, whose traces would otherwise be shared between the two. Run by
``nox -s kernels`` (which installs gemma for it); the ``tests`` sessions do not collect
this directory.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# The quantization rule's arguments per case; w8a8 quantizes each activation row.
RULES = {
    "int8": 'weight_qtype="int8"',
    "int4": 'weight_qtype="int4"',
    "nf4": 'weight_qtype="nf4"',
    "w8a8": 'weight_qtype="int8", act_qtype="int8"',
}


def _script(qtype: str, out: str) -> str:
    return textwrap.dedent(
        f"""
        import sys
        import jax, jax.numpy as jnp, numpy as np
        from gemma import gm
        from gemma.gm.nn import _modules
        import qflax
        from qcore.ops import kernels

        config = gm.nn.config.TransformerConfig(
            num_embed=256, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
            num_kv_heads=1, final_logit_softcap=None, use_post_attn_norm=True,
            use_post_ffw_norm=True, use_qk_norm=True,
            attention_types=(
                _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
            ),
            sliding_window_size=8, transpose_gating_einsum=True, vision_encoder=None,
        )
        model = gm.nn.Transformer(config=config, dtype=jnp.float32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (1, 8)), jnp.int32)
        key = jax.random.key(0)
        rule = qflax.QuantizationRule({RULES[qtype]})
        qmodel = qflax.quantize_model(model, qflax.PtqProvider([rule]))
        params = jax.jit(qmodel.init)(key, tokens)["params"]
        cache = qmodel.init_cache(batch_size=1, dtype=jnp.float32, cache_length=16)

        @jax.jit
        def step(params, cache, token, t):
            mask = jnp.broadcast_to(jnp.arange(16) <= t, (1, 1, 16))
            out = qmodel.apply(
                {{"params": params}}, token[:, None], cache=cache,
                positions=jnp.full((1, 1), t, jnp.int32), attention_mask=mask,
            )
            return out.logits[:, 0], out.cache

        text = step.lower(params, cache, tokens[:, 0], jnp.int32(0)).as_text()
        logits = []
        for t in range(8):
            out, cache = step(params, cache, tokens[:, t], jnp.int32(t))
            logits.append(np.asarray(out))
        np.save("{out}", np.stack(logits))
        print(text.count("qkernels_"))
        """
    )


def _decode(qtype: str, native: bool, tmp_path) -> tuple[np.ndarray, int]:
    out = tmp_path / f"{qtype}_{native}.npy"
    env = os.environ | {"QCORE_NATIVE_KERNELS": "1" if native else "0"}
    run = subprocess.run(
        [sys.executable, "-c", _script(qtype, str(out))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return np.load(out), int(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("qtype", list(RULES))
def test_batch_one_decode_is_bit_for_bit_with_and_without_qkernels(qtype, tmp_path):
    native, calls = _decode(qtype, True, tmp_path)
    xla, no_calls = _decode(qtype, False, tmp_path)
    assert calls > 0 and no_calls == 0, (calls, no_calls)
    assert np.isfinite(native).all() and np.abs(native).max() > 0
    np.testing.assert_array_equal(native, xla)
