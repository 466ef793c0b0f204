"""cuDNN flash attention against XLA's, on one random batch of a benchmark's shapes.

`compare(cfg, batch, seq)` draws one q, k, v (normal: logits q.k / sqrt(H) of unit spread)
of the model's global attention shapes [batch, seq, heads, head_dim] in its compute dtype
(K = n_kv_heads KV heads for the Qwen block), with a random cotangent, and runs causal
attention forward and backward (`models.attention.causal_attention`) on one device three ways:
cuDNN, XLA, and XLA on the fp32 upcast of the same inputs (the reference). For the output
and the q, k, v gradients it records the max absolute difference and the relative L2
error ||a - b|| / ||b|| of cuDNN against XLA, and of each against the fp32 reference (so
cuDNN's error reads beside XLA's own rounding). Where cuDNN cannot run (CPU, fp32) it
records why instead. bench_train writes the result into its JSON.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.models.attention import attention_implementation, causal_attention

OUTPUTS = ("out", "dq", "dk", "dv")


def _forward_backward(impl: str, q, k, v, ct):
  out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, impl), q, k, v)
  return (out, *vjp(ct))


def _errors(got, ref) -> dict:
  """Per output: max |got - ref| and ||got - ref|| / ||ref||, in fp32."""
  out = {}
  for name, a, b in zip(OUTPUTS, got, ref):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    out[name] = dict(max_abs=jnp.max(jnp.abs(a - b)),
                     rel_l2=jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  return out


@jax.jit
def _compare(*args) -> dict:
  """One program: the three implementations on q, k, v, cotangent `args`, compared."""
  cudnn, xla = (_forward_backward(impl, *args) for impl in ("cudnn", "xla"))
  ref = _forward_backward("xla", *(x.astype(jnp.float32) for x in args))
  return dict(cudnn_vs_xla=_errors(cudnn, xla), cudnn_vs_fp32=_errors(cudnn, ref),
              xla_vs_fp32=_errors(xla, ref))


def compare(cfg, batch: int, seq: int, seed: int = 0) -> dict:
  """The comparison above for model config `cfg` (GPTConfig / QwenConfig)."""
  q_shape = (batch, seq, cfg.n_heads, cfg.head_dim)
  kv_shape = (batch, seq, cfg.kv_heads, cfg.head_dim)
  dt = cfg.compute_dtype
  info = dict(q_shape=list(q_shape), kv_shape=list(kv_shape), dtype=jnp.dtype(dt).name)
  q, k = (jax.ShapeDtypeStruct(s, dt) for s in (q_shape, kv_shape))
  try:
    attention_implementation("cudnn", q, k, k)
  except ValueError as e:
    return dict(info, cudnn="unavailable", reason=str(e))
  rng = np.random.default_rng(seed)  # on the host: no PRNG program to compile
  args = [jnp.asarray(rng.standard_normal(s, np.float32), dt)
          for s in (q_shape, kv_shape, kv_shape, q_shape)]
  errors = jax.tree.map(float, jax.device_get(_compare(*args)))
  return dict(info, cudnn="compared", **errors)


def summary_line(result: dict) -> str:
  """One printable line of a `compare` result."""
  if result["cudnn"] != "compared":
    return f"attention numerics: cuDNN unavailable ({result['reason']})"
  e = result["cudnn_vs_xla"]
  return ("attention numerics, cuDNN vs XLA on q " + "x".join(map(str, result["q_shape"]))
          + f" {result['dtype']}: " + ", ".join(
              f"{n} rel {e[n]['rel_l2']:.2e} max {e[n]['max_abs']:.2e}" for n in OUTPUTS)
          + f" (XLA vs fp32: out rel {result['xla_vs_fp32']['out']['rel_l2']:.2e})")
