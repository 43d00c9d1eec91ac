"""The drafter exported to ONNX (KV injection as one dflash::KVInject node, the rest standard ops)
runs in onnxruntime on CPU, the node implemented through onnxruntime-extensions, and matches the
PyTorch drafter module + the target's embedding / lm_head (loaded by the runtime's own loader)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from dflash_trt.errors import DFlashError

from helpers import run_cli


@functools.cache    # once: onnxruntime refuses a second kernel for the same op
def register_kv_inject() -> None:
    """The KVInject node for onnxruntime, through onnxruntime-extensions' Python ops (domain
    "ai.onnx.contrib"), computed by dflash_trt.runtime.kv_inject path (2)."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    from dflash_trt.kernels import kv_inject_trt as trt_mod
    from dflash_trt.runtime.kv_inject import fused_kv_from_ctx, scatter_paged

    f, i32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32

    @onnx_op(op_type=trt_mod.PLUGIN_NAME, inputs=[f, f, f, f, f, f, i32, i32, f, f, f], outputs=[f, f],
             attrs={"num_layers": PyCustomOpDef.dt_int64, "num_kv_heads": PyCustomOpDef.dt_int64,
                    "head_dim": PyCustomOpDef.dt_int64, "page_size": PyCustomOpDef.dt_int64,
                    "plugin_namespace": PyCustomOpDef.dt_string, "aot": PyCustomOpDef.dt_int64})
    def _kv_inject(ctx_raw, w_kv, b_kv, k_norm_w, cos, sin, positions, slots, scalars, k_cache, v_cache, **attrs):
        L, nkv, page, hd = (int(attrs[k]) for k in ("num_layers", "num_kv_heads", "page_size", "head_dim"))
        T, H = ctx_raw.shape   # the plugin's I/O shapes (kernels/kv_inject_trt.py docstring)
        n = L * 2 * nkv * hd
        assert (w_kv.shape, b_kv.shape, k_norm_w.shape, positions.shape, slots.shape, scalars.shape) == (
            (n, H), (n,), (L, hd), (T,), (T,), (3,))
        assert cos.shape[1] == sin.shape[1] == hd and k_cache.shape[1:] == v_cache.shape[1:] == (L, nkv, page, hd)
        t = torch.from_numpy
        k, v = fused_kv_from_ctx(t(ctx_raw), t(w_kv).T, t(b_kv), t(k_norm_w), t(cos), t(sin),
                                 t(positions).long(), float(scalars[0]), L, nkv)
        k_out, v_out = t(k_cache.copy()), t(v_cache.copy())
        scatter_paged(k, v, t(slots), k_out, v_out, page)
        return k_out.numpy(), v_out.numpy()


def onnxruntime_session(model_or_path):
    """An onnxruntime CPU session for the exported drafter, its dflash custom node moved to the
    Python-op domain register_kv_inject implements."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    from dflash_trt.bundle.onnx_export import CUSTOM_DOMAIN

    register_kv_inject()
    m = onnx.load(str(model_or_path)) if isinstance(model_or_path, (str, Path)) else model_or_path
    m = onnx.ModelProto.FromString(m.SerializeToString())
    for item in [*m.graph.node, *m.opset_import]:
        if item.domain == CUSTOM_DOMAIN:
            item.domain = "ai.onnx.contrib"
    so = ort.SessionOptions()
    so.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dflash_trt.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("onnx")
    make_tiny("qwen3", root / "target", root / "drafter", seed=3)
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def exported(pair, tmp_path_factory):
    from dflash_trt.bundle.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx_out") / "drafter.onnx"
    return export_onnx(pair[1], pair[0], out, page_size=4)


def test_graph_shape(exported):
    m = onnx.load(str(exported))
    onnx.checker.check_model(m)
    custom = [n for n in m.graph.node if n.domain != ""]
    assert [(n.domain, n.op_type) for n in custom] == [("dflash", "KVInject")]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in custom[0].attribute}
    assert attrs["plugin_namespace"] == b"dflash" and attrs["aot"] == 1 and attrs["page_size"] == 4
    assert {n.op_type for n in m.graph.node} - {"KVInject"} <= set(
        s.name for s in onnx.defs.get_all_schemas() if s.domain == "")


def test_onnxruntime_matches_pytorch(pair, exported):
    from dflash_trt.models.drafter import load_drafter
    from dflash_trt.models.target import load_target
    from dflash_trt.runtime.kv_inject import reference_inject_paged

    target_dir, drafter_dir = pair
    drafter = load_drafter(drafter_dir, torch.float32)
    target = load_target(target_dir, torch.float32)
    c = drafter.config
    g = torch.Generator().manual_seed(0)
    n0, T, B, page, n_pages = 9, 6, c.block_size, 4, 12
    feats = torch.randn(n0 + T, c.n_features * c.hidden_size, generator=g)
    pos = torch.arange(n0 + T)
    # slots on shuffled, non-contiguous pages (a block table as a serving engine would hand out)
    block_table = torch.randperm(n_pages, generator=g)
    slots = block_table[pos // page] * page + pos % page
    shape = (n_pages, c.num_hidden_layers, c.num_key_value_heads, page, c.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    reference_inject_paged(drafter, feats[:n0], pos[:n0], slots[:n0], k_cache, v_cache, page)  # earlier steps
    block_ids = torch.full((B,), c.mask_token_id)
    block_ids[0] = 17
    q_pos = torch.arange(n0 + T, n0 + T + B)

    sess = onnxruntime_session(exported)
    logits, k_out, v_out = sess.run(None, {
        "features": feats[n0:].numpy(), "positions": pos[n0:].int().numpy(), "slots": slots[n0:].int().numpy(),
        "k_cache": k_cache.numpy(), "v_cache": v_cache.numpy(), "block_ids": block_ids.numpy(),
        "block_positions": q_pos.numpy(), "ctx_slots": slots.numpy()})

    with torch.no_grad():
        ctx_kv = drafter.context_kv(drafter.project_context(feats), pos)
        want = target.logits(drafter.forward_cached(target.embed(block_ids), q_pos, ctx_kv))
    np.testing.assert_allclose(logits, want.numpy(), atol=1e-4, rtol=1e-4)
    # the cache the graph returns holds every layer's K/V at the new slots
    for l, (k, v) in enumerate(ctx_kv):
        s = slots[n0:]
        np.testing.assert_allclose(k_out[s // page, l, :, s % page], k[:, n0:].transpose(0, 1).numpy(), atol=1e-5)
        np.testing.assert_allclose(v_out[s // page, l, :, s % page], v[:, n0:].transpose(0, 1).numpy(), atol=1e-5)
    assert logits.shape == (B, target.logits(torch.zeros(1, c.hidden_size)).shape[-1])


def test_bad_inputs(pair, tmp_path):
    from dflash_trt.bundle.onnx_export import export_onnx
    from dflash_trt.models.tiny import make_tiny

    with pytest.raises(DFlashError, match="power of two"):
        export_onnx(pair[1], pair[0], tmp_path / "x.onnx", page_size=12)
    other = tmp_path / "other"
    make_tiny("llama", other, None, seed=1)
    import json
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 48
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="hidden_size 48 does not match"):
        export_onnx(pair[1], other, tmp_path / "y.onnx")
    assert not (tmp_path / "y.onnx").exists()


def test_cli_export(pair, tmp_path):
    import json

    out = tmp_path / "d.onnx"
    code, stdout, err = run_cli("export-onnx", "--drafter", str(pair[1]), "--target", str(pair[0]),
                                "--out", str(out), "--json")
    assert code == 0, stdout + err
    assert json.loads(stdout)["onnx"] == str(out) and out.is_file()
    assert err.strip() == ""   # --json: the terminal shows nothing but the JSON


def test_external_data_export_is_the_same_model(pair, exported, tmp_path, monkeypatch):
    """A model over EXTERNAL_DATA_ABOVE streams its weights into drafter.onnx.data as the graph is
    built (real-size drafters: protobuf stops at 2 GiB); onnx loads it back to the same tensors
    and onnxruntime runs it (forced here on the tiny pair by lowering the threshold)."""
    from onnx import numpy_helper

    from dflash_trt.bundle import onnx_export
    from dflash_trt.io.manifest import HashCache, sha256_file

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_ABOVE", 0)
    hashes = HashCache()
    out = onnx_export.export_onnx(pair[1], pair[0], tmp_path / "drafter.onnx", page_size=4, hashes=hashes)
    assert hashes.linked(tmp_path / "drafter.onnx.data") == sha256_file(tmp_path / "drafter.onnx.data")
    assert (tmp_path / "drafter.onnx.data").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        "drafter.onnx", "drafter.onnx.data"]
    small = onnx.load(str(out), load_external_data=False)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in small.graph.initializer) > 10
    a, b = onnx.load(str(out)), onnx.load(str(exported))
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    want = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    assert got.keys() == want.keys()
    for k, w in want.items():
        np.testing.assert_array_equal(got[k], w)
    onnxruntime_session(out)


def test_external_data_offsets_survive_odd_sizes(tmp_path):
    """Initializers whose byte sizes are not multiples of the alignment read back exactly (onnx's
    own loader follows each tensor's location / offset / length)."""
    from onnx import TensorProto, helper, numpy_helper

    from dflash_trt.bundle.onnx_export import ExternalData

    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(1001, dtype=np.int64),
              "c": rng.standard_normal((7, 11, 13)).astype(np.float32)}
    data = ExternalData(tmp_path / "m.onnx.data")
    inits = [data.tensor(n, a.shape, a.dtype, [a[:1], a[1:]]) for n, a in arrays.items()]   # in two slabs
    data.close()
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])
    graph = helper.make_graph([helper.make_node("Identity", ["a"], ["y"])], "g", [], [out], inits)
    onnx.save_model(helper.make_model(graph), str(tmp_path / "m.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    for n, a in arrays.items():
        np.testing.assert_array_equal(got[n], a)
