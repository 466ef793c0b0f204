"""GPT model: shapes and dtypes, causality, injectable linear layers, parameter/FLOP counts,
and the choice of attention implementation (`model.attention`)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taco_jax.models.attention import attention_implementation, causal_attention
from taco_jax.models.decoder import count_params, flops_per_token, loss_fn, num_params
from taco_jax.models.gpt import GPT, Block, GPTConfig
from taco_jax.models.layers import DenseFactory, Linear
from taco_jax import testing

CFG = GPTConfig(vocab_size=256, n_layers=2, d_model=32, n_heads=4, d_ff=64, max_seq_len=16,
                dtype='float32')


def _tokens(b, t, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 256)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_shapes_and_dtypes(dtype):
  cfg = dataclasses.replace(CFG, dtype=dtype)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  logits = nnx.jit(lambda m, t: m(t))(model, _tokens(2, 16))  # one program: op by op is slow
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  loss, aux = nnx.jit(loss_fn)(model, _tokens(2, 17))
  assert loss.shape == () and loss.dtype == jnp.float32 and aux['loss'] == loss
  assert abs(float(loss) - math.log(256)) < 0.5  # near-uniform at init
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_param_and_flop_counts():
  model = GPT(CFG, rngs=nnx.Rngs(0))
  assert count_params(model) == num_params(CFG)
  n_matmul = num_params(CFG) - CFG.max_seq_len * CFG.d_model
  assert flops_per_token(CFG, 8) == 6 * n_matmul + 12 * CFG.n_layers * CFG.d_model * 8
  big = GPTConfig(vocab_size=50304, n_layers=12, d_model=768, n_heads=12, d_ff=3072,
                  max_seq_len=1024)
  assert 120e6 < num_params(big) < 130e6  # GPT-2 small


def test_causal():
  """d out[t] / d h[s] == 0 for s > t, on the embedded hidden stream; nonzero for s <= t."""
  model = GPT(CFG, rngs=nnx.Rngs(0))
  h = model.embed(_tokens(1, 16))
  t = 7
  g = jax.jit(jax.grad(lambda h: model.trunk(h)[0, t].sum()))(h)
  per_pos = np.abs(np.asarray(g[0])).sum(-1)
  assert np.all(per_pos[t + 1:] == 0)
  assert np.all(per_pos[:t + 1] > 0)


@dataclasses.dataclass(frozen=True)
class HalfShardFactory:
  """Stands in for a tp=2 factory: column layers keep half the outputs, row layers take half
  the inputs (whole heads, since QKV is head-major). No communication: it only checks that
  the block derives its local head count from the projection width."""

  def column(self, d_in, d_out, *, init_std, rngs):
    return Linear(d_in, d_out // 2, init_std=init_std, dtype=jnp.float32, rngs=rngs)

  def row(self, d_in, d_out, *, init_std, rngs):
    return Linear(d_in // 2, d_out, init_std=init_std, dtype=jnp.float32, rngs=rngs)


def test_block_linear_injection_local_heads():
  full = Block(CFG, rngs=nnx.Rngs(0), linear=DenseFactory(jnp.float32))
  half = Block(CFG, rngs=nnx.Rngs(0), linear=HalfShardFactory())
  assert half.qkv.kernel.shape == (32, 48) and half.attn_out.kernel.shape == (16, 32)
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  assert half(x).shape == full(x).shape == (2, 16, 32)
  # The half block equals the full block restricted to heads 0..1 (whole-head column shard).
  half.qkv.kernel[...] = full.qkv.kernel[...][:, :48]
  half.qkv.bias[...] = full.qkv.bias[...][:48]
  half.attn_out.kernel[...] = full.attn_out.kernel[...][:16]
  ln_x = full.ln1(x)
  a_half = half.attention(ln_x)
  qkv = (ln_x @ full.qkv.kernel[...] + full.qkv.bias[...]).reshape(2, 16, 4, 3, 8)
  o = jax.nn.dot_product_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], is_causal=True)
  ref = o[:, :, :2].reshape(2, 16, 16) @ full.attn_out.kernel[...][:16] + full.attn_out.bias[...]
  np.testing.assert_allclose(a_half, ref, rtol=1e-5, atol=1e-5)


def test_qwen_param_count_and_flops():
  """MFU of the Qwen block counts its own matmuls: GQA projections, SwiGLU, no wpe."""
  from taco_jax.models.qwen import Qwen, QwenConfig
  cfg = QwenConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=16,
                   dtype='float32')
  assert count_params(Qwen(cfg, rngs=nnx.Rngs(0))) == num_params(cfg)
  assert flops_per_token(cfg, 16) == 6.0 * num_params(cfg) + 12.0 * 2 * 64 * 16


def _written_out_attention(q_BTNH, k_BTKH, v_BTKH):
  """Causal softmax attention spelled out in fp32 (each KV head shared by N / K query heads):
  the spec `causal_attention` must meet whatever implementation it picks."""
  g = q_BTNH.shape[2] // k_BTKH.shape[2]
  k_BTNH, v_BTNH = (jnp.repeat(x, g, axis=2) for x in (k_BTKH, v_BTKH))
  s_BNTS = jnp.einsum('btnh,bsnh->bnts', q_BTNH, k_BTNH) / math.sqrt(q_BTNH.shape[-1])
  t = q_BTNH.shape[1]
  s_BNTS = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s_BNTS, -jnp.inf)
  return jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(s_BNTS, axis=-1), v_BTNH)


@pytest.mark.parametrize('n_kv', [4, 2], ids=['gpt', 'gqa'])
def test_attention_on_cpu_is_the_xla_path(n_kv):
  """On CPU `auto` picks XLA (cuDNN needs a GPU), runs exactly what `xla` runs, and both
  equal attention written out, for the GPT block (K = N heads) and GQA (K < N)."""
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, n, 16))
             for i, n in enumerate((4, n_kv, n_kv)))
  assert attention_implementation('auto', q, k, v) == 'xla'
  assert attention_implementation('xla', q, k, v) == 'xla'
  auto = causal_attention(q, k, v)  # 'auto' is the default
  np.testing.assert_array_equal(auto, causal_attention(q, k, v, 'xla'))
  tol = 64 * testing.unit_roundoff(jnp.float32)
  np.testing.assert_allclose(auto, _written_out_attention(q, k, v), rtol=tol, atol=tol)


def test_attention_choice_errors():
  """`cudnn` where cuDNN cannot run is an error that says why; unknown names are errors, in
  the config (GPT and Qwen) as in the function."""
  from taco_jax.models.qwen import QwenConfig
  q = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"model.attention=cudnn: cuDNN flash attention refuses "
                     r"q \(1, 16, 4, 8\) bfloat16: no GPU \(backend 'cpu'\); use attention=auto "
                     r"or xla"):
    attention_implementation('cudnn', q, q, q)
  with pytest.raises(ValueError, match='no GPU'):
    dataclasses.replace(CFG, attention='cudnn').attention_backend()
  assert dataclasses.replace(CFG, attention='auto').attention_backend(8) == 'xla'
  for make in (lambda: dataclasses.replace(CFG, attention='flash'),
               lambda: QwenConfig(attention='flash'),
               lambda: attention_implementation('flash', q, q, q)):
    with pytest.raises(ValueError, match=r"attention='flash' is unknown; use one of "
                       r"\('auto', 'cudnn', 'xla'\)"):
      make()


def test_registry_names_every_model_on_the_decoder_base(monkeypatch):
  """Each `model.block` name round-trips through the registry to one config, model and
  block class on the shared base, and each model and block is built by the base __init__."""
  from taco_jax import models
  from taco_jax.models.decoder import Decoder, DecoderBlock, DecoderConfig
  built = []

  def recording(init):
    def wrapped(self, *args, **kwargs):
      built.append(type(self))
      init(self, *args, **kwargs)
    return wrapped

  for base in (Decoder, DecoderBlock):
    monkeypatch.setattr(base, '__init__', recording(base.__init__))
  assert sorted(models.MODELS) == ['gpt', 'qwen']
  for name, model in models.MODELS.items():
    cfg = models.model_config(dict(block=name, n_layers=1, d_model=16, n_heads=2))
    assert type(cfg) is model.config_class and issubclass(type(cfg), DecoderConfig)
    assert models.kind(cfg) == name and models.model_class(cfg) is model
    assert issubclass(model, Decoder) and issubclass(models.block_class(cfg), DecoderBlock)
    built.clear()
    nnx.eval_shape(lambda: model(cfg, rngs=nnx.Rngs(0)))
    assert built == [model, model.block_class]
  with pytest.raises(TypeError, match='DecoderConfig is not a model config'):
    models.kind(DecoderConfig())


def test_model_fields_belong_to_their_model():
  """GPTConfig holds the shared fields, its MLP's activation and its QKV split; Qwen's own
  fields are QwenConfig's, and a model section may carry them for either block (it is
  shared); a GELU or a QKV split that is neither XLA's nor fused is an error."""
  from taco_jax import models
  from taco_jax.models.decoder import DecoderConfig
  from taco_jax.models.qwen import QwenConfig
  names = lambda c: {f.name for f in dataclasses.fields(c)}
  assert names(GPTConfig) - names(DecoderConfig) == {'mlp_gelu', 'qkv_split'}
  assert names(QwenConfig) - names(DecoderConfig) == {'n_kv_heads', 'rope_theta'}
  assert models.model_config(dict(n_kv_heads=1, rope_theta=1.0)) == GPTConfig()
  assert models.model_config(dict(block='qwen', mlp_gelu='fused')) == QwenConfig()
  with pytest.raises(ValueError, match=r"mlp_gelu='tanh' is unknown; use one of \('xla', "
                     r"'fused'\)"):
    models.model_config(dict(mlp_gelu='tanh'))
  with pytest.raises(ValueError, match=r"qkv_split='heads' is unknown; use one of \('xla', "
                     r"'fused'\)"):
    models.model_config(dict(qkv_split='heads'))
  with pytest.raises(ValueError, match=r"unknown model config field\(s\) \['n_kv_head'\]; "
                     r"known: \[.*'n_kv_heads'"):
    models.model_config(dict(block='qwen', n_kv_head=1))
  with pytest.raises(ValueError, match=r"model.block='llama' is unknown; use one of "
                     r"\['gpt', 'qwen'\]"):
    models.model_config(dict(block='llama'))
