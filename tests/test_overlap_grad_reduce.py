"""`parallel.overlap_grad_reduce`: each layer's gradients all-reduced over "data" inside the
backward pass (`buckets.all_reduce_in_backward`) against the one all-reduce after it.

A tiny fp32 GPT on 8 CPU devices: the same loss and gradients, one data all-reduce per
layer in the compiled step, FP8 messages when compressed, and the layouts it refuses.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import testing
from taco_jax.codec import CompressionConfig
from taco_jax.plan import CompressionPlan
from taco_jax.testing import hlo
from taco_jax.tp import layout as layout_lib, step as step_lib
from taco_jax.tp.mesh import DATA, make_mesh

CFG = layout_lib.model_config(dict(vocab_size=128, n_layers=3, d_model=32, n_heads=4, d_ff=64,
                                   max_seq_len=16, dtype="float32"))
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)
CODEC = CompressionConfig(format="e4m3", group_size=32)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache  # the tests share their programs
def _loss_and_grads(layout, overlap, plan=CompressionPlan(), scan_layers=True):
  """(loss, grads as numpy, the compiled program's collectives over "data") of one step."""
  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp, jax.devices()[:dp * pp * tp])
  spec = step_lib.ParallelSpec(CFG, dp, pp, tp, 1, plan, scan_layers=scan_layers,
                               overlap_grad_reduce=overlap)
  params = layout_lib.init_params(CFG, mesh, seed=0)
  tokens = jax.device_put(
      jax.random.randint(jax.random.key(1), (8, 17), 0, CFG.vocab_size),
      step_lib.batch_sharding(mesh))
  exe = jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens).compile(
      FAST_COMPILE)
  loss, grads = exe(params, tokens)
  over_data = [c for c in hlo.collectives(exe.as_text(), mesh) if c.axes == frozenset({DATA})]
  return float(loss), jax.device_get(grads), over_data


@pytest.mark.parametrize("layout, scan_layers", [((8, 1, 1), False), ((2, 1, 4), True)],
                         ids=["dp8-unrolled", "dp2-tp4-scan"])
def test_same_loss_and_gradients_as_reducing_after_the_backward_pass(layout, scan_layers):
  loss, grads, _ = _loss_and_grads(layout, False, scan_layers=scan_layers)
  loss_o, grads_o, _ = _loss_and_grads(layout, True, scan_layers=scan_layers)
  np.testing.assert_allclose(loss_o, loss, rtol=F32_TOL)
  for (path, g), g_o in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(grads_o)):
    scale = float(np.max(np.abs(g))) or 1.0
    np.testing.assert_allclose(g_o, g, atol=F32_TOL * scale, err_msg=str(path))


def test_one_data_all_reduce_per_layer_in_the_compiled_step():
  """Unrolled, each layer's gradients are their own all-reduce (whose operands the
  backward pass makes layer by layer), besides the one of the embedding and the head."""
  all_reduces = lambda colls: [c for c in colls if c.kind == "all-reduce"]  # noqa: E731
  after = all_reduces(_loss_and_grads((8, 1, 1), False, scan_layers=False)[2])
  inside = all_reduces(_loss_and_grads((8, 1, 1), True, scan_layers=False)[2])
  assert len(after) == 1
  assert len(inside) == CFG.n_layers + 1
  assert sum(c.elements for c in inside) >= sum(c.elements for c in after) * 0.99


def test_compressed_per_layer_gradients_travel_as_fp8():
  """Each layer's message is the codec's wire (the compressed all-reduce gathers u8 rows at
  these sizes), and the gradients stay within a few FP8 roundings of the plain ones."""
  plain, plain_grads, _ = _loss_and_grads((8, 1, 1), True, scan_layers=False)
  loss, grads, over_data = _loss_and_grads((8, 1, 1), True, CompressionPlan(dp=CODEC),
                                           scan_layers=False)
  assert loss == pytest.approx(plain, rel=F32_TOL)  # the forward pass is not compressed
  assert {c.dtype for c in over_data} == {"u8"}
  assert len([c for c in over_data if c.kind == "all-gather"]) == CFG.n_layers + 1
  flat = lambda t: np.concatenate([x.ravel() for x in jax.tree.leaves(t)])  # noqa: E731
  rel = np.linalg.norm(flat(grads) - flat(plain_grads)) / np.linalg.norm(flat(plain_grads))
  assert 0 < rel < 4 * testing.unit_roundoff(CODEC.fp8_dtype)


@pytest.mark.parametrize("fields, named", [
    (dict(pp=2, microbatches=2), "parallel.pp=1"),
    (dict(microbatches=2), "parallel.microbatches=1"),
    (dict(shard_optimizer=True), "parallel.shard_optimizer=False")])
def test_layouts_that_reduce_more_than_once_are_refused(fields, named):
  args = dict(dp=2, pp=1, tp=1, microbatches=1) | fields
  with pytest.raises(ValueError, match="overlap_grad_reduce") as e:
    step_lib.ParallelSpec(CFG, args.pop("dp"), args.pop("pp"), args.pop("tp"),
                          args.pop("microbatches"), overlap_grad_reduce=True, **args)
  assert named in str(e.value)
