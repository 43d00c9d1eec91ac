"""The DFlash drafter as an ONNX graph for TensorRT's ONNX parser (docs/decode-loop.md, docs/kernels.md).

One draft step: inject the accepted tokens' features into the paged drafter cache (ONE custom node, op
`KVInject` in domain "dflash", mapped by TensorRT's ONNX parser to the `dflash::KVInject` plugin,
kernels/kv_inject_trt.py), then draft a block over everything in the cache; the rest is standard ONNX
(opset 18). Graph inputs and outputs: _graph_inputs / _graph_outputs. The drafter has no embedding and no
lm_head: only those two tensors are read from the target folder (so a 120B target exports on a small
machine). tests/test_onnx_export.py runs the graph in onnxruntime.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open

from dflash_trt.errors import DFlashError
from dflash_trt.io.atomic import disk_error, no_new_empty_dirs, temp_dir_beside
from dflash_trt.io.checkpoint import CheckpointReader
from dflash_trt.io.jsonio import read_json
from dflash_trt.kernels import kv_inject_trt
from dflash_trt.models.config import load_drafter_config
from dflash_trt.models.drafter import DFlashDrafter, _hf_rope_config, load_drafter
from dflash_trt.models.layers import RopeTable
from dflash_trt.runtime.kv_inject import FusedKVInjector, check_page_size

OPSET = 18
CUSTOM_DOMAIN = "dflash"
EXTERNAL_DATA_ABOVE = 1 << 30  # protobuf stops at 2 GiB: big drafters keep weights in a side file


# ---------------------------------------------------------------------------------- target tensors
class TensorRows:
    """One 2-D tensor of a safetensors file, read a slab of rows at a time as float32 (a
    201088 x 2880 bf16 embedding is 1.2 GB, 2.3 GB as float32: never held whole)."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        with safe_open(str(path), "pt") as f:
            self.shape = tuple(f.get_slice(name).get_shape())

    def slabs(self, rows: int = 8192):
        with safe_open(str(self.path), "pt") as f:
            sl = f.get_slice(self.name)
            for r in range(0, self.shape[0], rows):
                yield sl[r:r + rows].to(torch.float32).numpy()


def target_head_rows(target_dir: str | Path) -> tuple[dict, TensorRows, TensorRows]:
    """(config, embed_tokens [V, H], lm_head [V, H]) of an HF target folder, as row sources of only those tensors."""
    target_dir = Path(target_dir)
    cfg = read_json(target_dir / "config.json")
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)["weight_map"]
    elif (target_dir / "model.safetensors").is_file():
        with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise DFlashError(f"{target_dir}: no model.safetensors or model.safetensors.index.json")

    def get(*names):
        return next((TensorRows(target_dir / weight_map[n], n) for n in names if n in weight_map), None)

    embed = get("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
    if embed is None:
        raise DFlashError(f"{target_dir}: tensor model.embed_tokens.weight missing")
    head = get("lm_head.weight")
    if head is None:
        if not cfg.get("tie_word_embeddings", False):
            raise DFlashError(f"{target_dir}: tensor lm_head.weight missing and tie_word_embeddings is false")
        head = embed
    return cfg, embed, head


class DrafterWeights:
    """A drafter whose tensors are read from its checkpoint one at a time, as float32, when the
    graph needs them: the module (`.module`) is built on the meta device, shapes only, so a
    real-size drafter (0.8B parameters, 3.1 GB as float32) is never in memory whole. Names are
    checked against the checkpoint as load_drafter checks them (missing / mis-shaped refused)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        cfg = load_drafter_config(folder)
        with torch.device("meta"):
            self.module = DFlashDrafter(cfg, max_len=16)
        self.module.rope = RopeTable(_hf_rope_config(cfg), cfg.max_position_embeddings, torch.float32)
        self.reader = CheckpointReader(folder)
        self._key: dict[int, str] = {}
        for name, p in self.module.named_parameters():
            key = name if name in self.reader else "model." + name   # speculators exports prefix `model.`
            if key not in self.reader:
                raise DFlashError(f"{folder}: tensor {name} missing from the checkpoint")
            if tuple(self.reader.meta(key)[1]) != tuple(p.shape):
                raise DFlashError(f"{folder}: tensor {name} has shape {tuple(self.reader.meta(key)[1])}, "
                                  f"config implies {tuple(p.shape)}")
            self._key[id(p)] = key

    def __call__(self, param: torch.Tensor) -> np.ndarray:
        return self.reader.get(self._key[id(param)]).to(torch.float32).numpy()

    def injector(self) -> FusedKVInjector:
        """FusedKVInjector over float32 copies of only the tensors it reads (fc, hidden_norm and
        each layer's k_proj, v_proj, k_norm), as load_drafter(dtype=float32) would give them."""
        d = self.module

        def t(p):
            return None if p is None else torch.from_numpy(self(p))

        def lin(m):
            return SimpleNamespace(weight=t(m.weight), bias=t(m.bias), out_features=m.out_features)

        layers = [SimpleNamespace(self_attn=SimpleNamespace(k_proj=lin(a.k_proj), v_proj=lin(a.v_proj),
                                                            k_norm=SimpleNamespace(weight=t(a.k_norm.weight))))
                  for a in (layer.self_attn for layer in d.layers)]
        return FusedKVInjector(SimpleNamespace(config=d.config, fc=SimpleNamespace(weight=t(d.fc.weight)),
                                               hidden_norm=SimpleNamespace(weight=t(d.hidden_norm.weight)),
                                               layers=layers, rope=d.rope))


# -------------------------------------------------------------------------------- graph building
class ExternalData:
    """The side file of a big model's weights, written as the graph is built: each initializer's
    bytes go to disk at once and the graph keeps only a reference (ONNX external data: location,
    offset, length), so the model is never in memory twice and no protobuf message passes 2 GiB.
    (onnx.save_model(save_as_external_data=True) needs the whole model in memory first.)"""

    ALIGN = 4096   # offsets page-aligned, as onnx's own writer can do, so readers may mmap them

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.f = open(path, "wb")  # noqa: SIM115 -- open for the graph build, closed by close()
        self.sha256 = hashlib.sha256()   # of the file as written: the bundle's manifest needs it

    def _write(self, b) -> None:
        self.f.write(b)
        self.sha256.update(b)

    def tensor(self, name: str, shape, dtype, slabs):
        import onnx
        from onnx import helper

        pad = -self.offset % self.ALIGN
        self._write(b"\0" * pad)
        start = self.offset = self.offset + pad
        for slab in slabs:
            self._write(memoryview(np.ascontiguousarray(slab)).cast("B"))
            self.offset += slab.nbytes
        t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape),
                             data_location=onnx.TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(start)), ("length", str(self.offset - start))):
            t.external_data.add(key=k, value=v)
        return t

    def close(self) -> None:
        self.f.close()


class _Graph:
    """Minimal ONNX graph builder: unique names, float32/int64 initializers (to `data` when given)."""

    EXTERNAL_MIN = 1024   # smaller initializers stay inline (onnx's own size_threshold)

    def __init__(self, data: ExternalData | None = None, weights=None):
        self.nodes, self.inits, self._n, self.data = [], [], 0, data
        self.w = weights or _np   # a drafter parameter -> float32 array (DrafterWeights: read on demand)

    def bias(self, linear) -> np.ndarray | None:
        return self.w(linear.bias) if linear.bias is not None else None

    def name(self, base):
        self._n += 1
        return f"{base}_{self._n}"

    def init(self, base, array) -> str:
        from onnx import numpy_helper

        n = self.name(base)
        a = np.array(array, order="C")  # keeps 0-d as 0-d
        if self.data is not None and a.nbytes >= self.EXTERNAL_MIN:
            self.inits.append(self.data.tensor(n, a.shape, a.dtype, [a]))
        else:
            self.inits.append(numpy_helper.from_array(a, n))
        return n

    def init_rows(self, base, rows: TensorRows) -> str:
        """A float32 initializer from a target tensor, streamed slab by slab when external."""
        if self.data is None:
            return self.init(base, np.concatenate(list(rows.slabs())))
        n = self.name(base)
        self.inits.append(self.data.tensor(n, rows.shape, np.float32, rows.slabs()))
        return n

    def ints(self, base, values) -> str:
        return self.init(base, np.asarray(values, dtype=np.int64))

    def op(self, op_type, inputs, n_out=1, domain=None, **attrs):
        from onnx import helper

        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    # composite helpers
    def rms_norm(self, x, weight, eps):
        sq = self.op("Mul", [x, x])
        ms = self.op("ReduceMean", [sq, self.ints("axes", [-1])], keepdims=1)
        rstd = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.init("eps", np.float32(eps))])])])
        return self.op("Mul", [self.op("Mul", [x, rstd]), self.init("norm_w", weight)])

    def linear(self, x, weight, bias=None):
        y = self.op("MatMul", [x, self.init("w_t", weight.T)])
        return self.op("Add", [y, self.init("b", bias)]) if bias is not None else y

    def rope(self, x, cos, sin, hd):
        half = hd // 2
        lo = self.op("Slice", [x, self.ints("s", [0]), self.ints("e", [half]), self.ints("ax", [-1])])
        hi = self.op("Slice", [x, self.ints("s", [half]), self.ints("e", [hd]), self.ints("ax", [-1])])
        rot = self.op("Concat", [self.op("Neg", [hi]), lo], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _graph_inputs(c, cache_shape) -> list:
    from onnx import TensorProto, helper

    return [
        helper.make_tensor_value_info("features", TensorProto.FLOAT, ["T", c.n_features * c.hidden_size]),
        helper.make_tensor_value_info("positions", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("slots", TensorProto.INT32, ["T"]),
        helper.make_tensor_value_info("k_cache", TensorProto.FLOAT, cache_shape),
        helper.make_tensor_value_info("v_cache", TensorProto.FLOAT, cache_shape),
        helper.make_tensor_value_info("block_ids", TensorProto.INT64, ["B"]),
        helper.make_tensor_value_info("block_positions", TensorProto.INT64, ["B"]),
        helper.make_tensor_value_info("ctx_slots", TensorProto.INT64, ["S"]),
    ]


def _graph_outputs(vocab: int, cache_shape) -> list:
    from onnx import TensorProto, helper

    return [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", vocab]),
        helper.make_tensor_value_info("k_cache_out", TensorProto.FLOAT, cache_shape),
        helper.make_tensor_value_info("v_cache_out", TensorProto.FLOAT, cache_shape),
    ]


def _kv_inject(g: _Graph, inj: FusedKVInjector, cos_tab: str, sin_tab: str, page_size: int) -> None:
    """fc (a standard MatMul: TensorRT's GEMM), then the fused plugin node writing every layer's
    K/V of the accepted tokens into the paged cache: outputs k_cache_out, v_cache_out."""
    from onnx import helper

    c = inj.config
    ctx_raw = g.op("MatMul", ["features", g.init("fc_w_t", _np(inj.fc_w_t))])
    scalars = g.init("kv_scalars", np.array([inj.eps, 1.0, 1.0], dtype=np.float32))
    plugin_inputs = [ctx_raw, g.init("w_kv", _np(inj.w_kv)), g.init("b_kv", _np(inj.b_kv)),
                     g.init("k_norm_w", _np(inj.k_norm_w)), cos_tab, sin_tab, "positions", "slots", scalars,
                     "k_cache", "v_cache"]
    assert len(plugin_inputs) == len(kv_inject_trt.INPUT_NAMES)
    g.nodes.append(helper.make_node(
        kv_inject_trt.PLUGIN_NAME, plugin_inputs, ["k_cache_out", "v_cache_out"], name="kv_inject",
        domain=CUSTOM_DOMAIN, num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim, page_size=page_size, plugin_namespace=kv_inject_trt.PLUGIN_NAMESPACE, aot=1))


def _gather_ctx(g: _Graph, cache: str, c) -> str:
    """Context K or V of every layer, gathered from the updated paged cache: [L, nkv, S, hd]."""
    L, nkv, hd = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    t = g.op("Transpose", [cache], perm=[1, 2, 0, 3, 4])                  # [L, nkv, P, page, hd]
    t = g.op("Reshape", [t, g.ints("shape", [L, nkv, -1, hd])])          # [L, nkv, P*page, hd]
    return g.op("Gather", [t, "ctx_slots"], axis=2)


def _attention(g: _Graph, a, x: str, l: int, k_all: str, v_all: str, cos_q: str, sin_q: str, scale: str, c) -> str:
    """Layer l's non-causal attention of the block over [context, block]: o_proj's output [B, H]."""
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = g.op("Reshape", [g.linear(x, g.w(a.q_proj.weight), g.bias(a.q_proj)), g.ints("shape", [-1, nh, hd])])
    q = g.op("Transpose", [g.rms_norm(q, g.w(a.q_norm.weight), a.q_norm.eps)], perm=[1, 0, 2])   # [nh, B, hd]
    q = g.rope(q, cos_q, sin_q, hd)
    k = g.op("Reshape", [g.linear(x, g.w(a.k_proj.weight), g.bias(a.k_proj)), g.ints("shape", [-1, nkv, hd])])
    k = g.rope(g.op("Transpose", [g.rms_norm(k, g.w(a.k_norm.weight), a.k_norm.eps)], perm=[1, 0, 2]),
               cos_q, sin_q, hd)                                                                 # [nkv, B, hd]
    v = g.op("Reshape", [g.linear(x, g.w(a.v_proj.weight), g.bias(a.v_proj)), g.ints("shape", [-1, nkv, hd])])
    v = g.op("Transpose", [v], perm=[1, 0, 2])
    li = g.init("layer", np.int64(l))
    K = g.op("Concat", [g.op("Gather", [k_all, li], axis=0), k], axis=1)                   # [nkv, S+B, hd]
    Vv = g.op("Concat", [g.op("Gather", [v_all, li], axis=0), v], axis=1)
    # GQA: query head i reads kv head i // (nh // nkv) -> group the queries per kv head
    qg = g.op("Reshape", [q, g.ints("shape", [nkv, -1, hd])])                              # [nkv, grp*B, hd]
    scores = g.op("Mul", [g.op("MatMul", [qg, g.op("Transpose", [K], perm=[0, 2, 1])]), scale])
    o = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), Vv])                            # [nkv, grp*B, hd]
    o = g.op("Reshape", [o, g.ints("shape", [nh, -1, hd])])                                 # [nh, B, hd]
    o = g.op("Reshape", [g.op("Transpose", [o], perm=[1, 0, 2]), g.ints("shape", [-1, nh * hd])])
    return g.linear(o, g.w(a.o_proj.weight), g.bias(a.o_proj))


def _mlp(g: _Graph, mlp, x: str) -> str:
    gate = g.linear(x, g.w(mlp.gate_proj.weight))
    up = g.linear(x, g.w(mlp.up_proj.weight))
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])                 # silu(gate) * up
    return g.linear(act, g.w(mlp.down_proj.weight))


def _decoder_layer(g: _Graph, layer, l: int, h: str, k_all: str, v_all: str, cos_q: str, sin_q: str, scale: str,
                   c) -> str:
    x = g.rms_norm(h, g.w(layer.input_layernorm.weight), layer.input_layernorm.eps)
    h = g.op("Add", [h, _attention(g, layer.self_attn, x, l, k_all, v_all, cos_q, sin_q, scale, c)])
    x = g.rms_norm(h, g.w(layer.post_attention_layernorm.weight), layer.post_attention_layernorm.eps)
    return g.op("Add", [h, _mlp(g, layer.mlp, x)])


def build_model(drafter, embed: TensorRows, lm_head: TensorRows, page_size: int, data: ExternalData | None = None,
                weights: DrafterWeights | None = None):
    """The ONNX ModelProto of `drafter` (float32) with the target's embedding and lm_head; the
    weights go to `data` as they are made when given (big models). `weights`: the drafter's
    tensors read on demand (then `drafter` is weights.module, on the meta device)."""
    import onnx
    from onnx import helper

    check_page_size(page_size)
    c = drafter.config
    H = c.hidden_size
    if embed.shape[1] != H or lm_head.shape[1] != H:
        raise DFlashError(f"target embed_tokens/lm_head have hidden size {embed.shape[1]}, the drafter config "
                          f"has hidden_size {H}")
    if c.n_features * H != drafter.fc.weight.shape[1]:
        raise DFlashError(f"fc.weight: shape {tuple(drafter.fc.weight.shape)} does not match {c.n_features} features")
    g = _Graph(data, weights)
    cache_shape = ["num_pages", c.num_hidden_layers, c.num_key_value_heads, page_size, c.head_dim]
    cos_tab, sin_tab = g.init("rope_cos", _np(drafter.rope.cos)), g.init("rope_sin", _np(drafter.rope.sin))

    _kv_inject(g, weights.injector() if weights else FusedKVInjector(drafter), cos_tab, sin_tab, page_size)
    k_all, v_all = _gather_ctx(g, "k_cache_out", c), _gather_ctx(g, "v_cache_out", c)

    # the draft pass (DFlashDrafter.forward_cached, mask=None: non-causal)
    h = g.op("Gather", [g.init_rows("embed_tokens", embed), "block_ids"], axis=0)   # [B, H]
    cos_q = g.op("Gather", [cos_tab, "block_positions"], axis=0)                     # [B, hd]
    sin_q = g.op("Gather", [sin_tab, "block_positions"], axis=0)
    scale = g.init("attn_scale", np.float32(1.0 / math.sqrt(c.head_dim)))
    for l, layer in enumerate(drafter.layers):
        h = _decoder_layer(g, layer, l, h, k_all, v_all, cos_q, sin_q, scale, c)
    h = g.rms_norm(h, g.w(drafter.norm.weight), drafter.norm.eps)
    # Gemm with transB: lm_head stays [V, H] as stored, so it streams by rows (no [H, V] copy)
    g.nodes.append(helper.make_node("Gemm", [h, g.init_rows("lm_head", lm_head)], ["logits"], name="lm_head", transB=1))

    graph = helper.make_graph(g.nodes, "dflash_drafter", _graph_inputs(c, cache_shape),
                              _graph_outputs(lm_head.shape[0], cache_shape), g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(CUSTOM_DOMAIN, 1)],
                              producer_name="dflash-trt")
    model.ir_version = 8  # onnxruntime >= 1.15 and TensorRT 10 both read IR 8
    model.metadata_props.append(onnx.StringStringEntryProto(key="dflash.page_size", value=str(page_size)))
    return model


def export_onnx(drafter_dir, target_dir, out_file, page_size: int = 16, hashes=None) -> Path:
    """Export the drafter at drafter_dir (with target_dir's embedding and lm_head) to out_file.
    Weights go to `<out_file>.data` beside it, written as the graph is built, when the model is
    over 1 GiB (float32); its sha256, taken while writing, is given to `hashes` (a
    bundle.manifest.HashCache) so that the bundle's manifest need not read it back."""
    import onnx

    check_page_size(page_size)
    dcfg = load_drafter_config(drafter_dir)
    if dcfg.kind != "dflash" or not dcfg.plain_attention:
        # the graph below is the non-causal, unwindowed DFlash draft pass with an argmax-able lm_head
        raise DFlashError(f"{drafter_dir}: export-onnx covers DFlash drafters with non-causal full attention; this "
                          f"is a {'DFlash2' if dcfg.kind == 'dflash2' else 'DFlash'} drafter"
                          + (" with causal or sliding-window layers" if not dcfg.plain_attention else "")
                          + " (serve it with a stack's own drafter: TensorRT-LLM, vLLM or SGLang configs)")
    if (Path(drafter_dir) / "hf_quant_config.json").is_file():   # FP8 / NVFP4: dequantized whole, as the runtime does
        weights, drafter = None, load_drafter(drafter_dir, dtype=torch.float32)
    else:
        weights = DrafterWeights(drafter_dir)
        drafter = weights.module
    tcfg, embed, head = target_head_rows(target_dir)
    if tcfg.get("hidden_size") != drafter.config.hidden_size:
        raise DFlashError(f"{Path(target_dir) / 'config.json'}: hidden_size {tcfg.get('hidden_size')} does not "
                          f"match the drafter's hidden_size {drafter.config.hidden_size}")
    n_params = sum(p.numel() for p in drafter.parameters()) + math.prod(embed.shape) + math.prod(head.shape)
    big = 4 * n_params > EXTERNAL_DATA_ABOVE
    out_file = Path(out_file)
    if out_file.is_dir():
        raise DFlashError(f"{out_file}: is a folder; --out names the ONNX file to write")
    data_name = out_file.name + ".data"
    with no_new_empty_dirs(out_file.parent):
        try:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_dir_beside(out_file)
        except OSError as e:
            raise disk_error(out_file.parent, "a temporary folder", e) from None
        try:
            data = ExternalData(tmp / data_name) if big else None
            try:
                model = build_model(drafter, embed, head, page_size, data, weights)
            finally:
                if data is not None:
                    data.close()
            onnx.save_model(model, str(tmp / out_file.name))
            onnx.checker.check_model(str(tmp / out_file.name))
            if big:
                os.replace(tmp / data_name, out_file.with_name(data_name))
                if hashes is not None:
                    hashes.remember(out_file.with_name(data_name), data.sha256.hexdigest())
            os.replace(tmp / out_file.name, out_file)
        except OSError as e:
            raise disk_error(out_file, "the ONNX file", e) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_file
