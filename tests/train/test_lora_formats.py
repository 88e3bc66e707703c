"""LoRA key formats without ComfyUI: names chosen from a ComfyUI-style key map, exact round trips, the split of a
fused projection, the scale alpha / rank in each format, what is left out, and clear refusals.

The tables here are built the way ``nodes/backend/compat.py`` builds them from ComfyUI's map, for a small model
with a fused qkv, a conv layer, a norm, a bias and a weight diffusers stores with its halves swapped. Weight deltas
are computed independently of the code under test, from what each format means."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from streaming_cache.errors import LoraFormatError
from streaming_cache.train import lora_formats as lf
from streaming_cache.train.lora_formats import ALPHA, DOWN, UP, NameTable, Target

SHAPES = {"diffusion_model.blocks.0.qkv.weight": (12, 4), "diffusion_model.blocks.0.proj.weight": (4, 4),
          "diffusion_model.blocks.0.proj.bias": (4,), "diffusion_model.conv.weight": (4, 2, 3, 3),
          "diffusion_model.norm.weight": (4,), "diffusion_model.final.weight": (8, 4)}
DIFFUSERS = {"transformer.blocks.0.attn.to_q": Target("diffusion_model.blocks.0.qkv.weight", (0, 4)),
             "transformer.blocks.0.attn.to_k": Target("diffusion_model.blocks.0.qkv.weight", (4, 4)),
             "transformer.blocks.0.attn.to_v": Target("diffusion_model.blocks.0.qkv.weight", (8, 4)),
             "transformer.blocks.0.proj_out": Target("diffusion_model.blocks.0.proj.weight"),
             "transformer.blocks.0.attn.to_out": Target("diffusion_model.blocks.0.proj.weight"),  # Flux 2's name
             "transformer.blocks.0.ff.linear_in": Target("diffusion_model.blocks.0.proj.weight"),  # LoKr's name
             "transformer.conv_in": Target("diffusion_model.conv.weight"),
             "transformer.norm": Target("diffusion_model.norm.weight"),
             "transformer.norm_out.linear": Target("diffusion_model.final.weight", swapped=True)}


def table(family: str = "Flux", extra: dict | None = None) -> NameTable:
    """What compat builds from ComfyUI's map: ComfyUI's own and kohya's native names of every weight, and
    diffusers' names (``extra`` adds more)."""
    targets: dict[str, Target] = {}
    for weight in SHAPES:
        if weight.endswith(".weight"):
            module = weight[:-len(".weight")]
            targets[module] = Target(weight)
            targets["lora_unet_" + module[len("diffusion_model."):].replace(".", "_")] = Target(weight)
    return NameTable({**targets, **DIFFUSERS, **(extra or {})}, SHAPES, family)


def comfy_lora(rank: int = 2, alpha: float = 3.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA as ComfyUI's trainer lays it out: 2-D matrices (conv flattened), alpha, offsets of the norm and a
    bias."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for weight, shape in SHAPES.items():
        if len(shape) < 2:
            continue
        m = weight[:-len(".weight")]
        out[f"{m}.{UP}"] = torch.randn(shape[0], rank, generator=g)
        out[f"{m}.{DOWN}"] = torch.randn(rank, int(torch.tensor(shape[1:]).prod()), generator=g)
        out[f"{m}.{ALPHA}"] = torch.tensor(alpha)
    out["diffusion_model.norm.diff"] = torch.randn(4, generator=g)
    out["diffusion_model.blocks.0.proj.diff_b"] = torch.randn(4, generator=g)
    return out


def comfy_deltas(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ComfyUI adds to each weight for a file in its own layout: alpha / rank * up @ down."""
    out = {}
    for key, up in lora.items():
        if key.endswith(UP):
            m = key[:-len(UP) - 1]
            down = lora[f"{m}.{DOWN}"]
            scale = float(lora[f"{m}.{ALPHA}"]) / down.shape[0] if f"{m}.{ALPHA}" in lora else 1.0
            out[f"{m}.weight"] = (scale * up.flatten(1) @ down.flatten(1)).reshape(SHAPES[f"{m}.weight"])
    return out


def diffusers_deltas(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a PEFT file adds to the model's weights (B @ A, no alpha), placed where the names say."""
    out: dict[str, torch.Tensor] = {}
    for name, target in DIFFUSERS.items():
        if f"{name}.lora_B.weight" not in lora:
            continue
        delta = lora[f"{name}.lora_B.weight"].flatten(1) @ lora[f"{name}.lora_A.weight"].flatten(1)
        if target.swapped:
            delta = torch.cat(delta.chunk(2)[::-1])
        full = out.setdefault(target.weight, torch.zeros(SHAPES[target.weight][0], delta.shape[1]))
        offset, count = target.rows or (0, full.shape[0])
        full[offset:offset + count] += delta
    return {w: d.reshape(SHAPES[w]) for w, d in out.items()}


def test_each_format_names_each_weight_as_its_readers_expect():
    t = table()
    assert t.names("comfyui")["diffusion_model.blocks.0.qkv.weight"] == ("diffusion_model.blocks.0.qkv",)
    assert t.names("kohya")["diffusion_model.blocks.0.qkv.weight"] == ("lora_unet_blocks_0_qkv",)
    assert t.names("diffusers")["diffusion_model.blocks.0.qkv.weight"] == (
        "transformer.blocks.0.attn.to_q", "transformer.blocks.0.attn.to_k", "transformer.blocks.0.attn.to_v")
    assert t.names("diffusers")["diffusion_model.blocks.0.proj.weight"] == ("transformer.blocks.0.proj_out",)


def test_kohya_names_sd1_by_diffusers_unet_names_and_sdxl_by_the_original_ones():
    extra = {"lora_unet_down_blocks_0_proj": Target("diffusion_model.blocks.0.proj.weight")}
    assert table("SD15", extra).names("kohya")["diffusion_model.blocks.0.proj.weight"] == ("lora_unet_down_blocks_0_proj",)
    assert table("SDXL", extra).names("kohya")["diffusion_model.blocks.0.proj.weight"] == ("lora_unet_blocks_0_proj",)


def test_comfyui_to_kohya_and_back_is_exact_and_kohya_leaves_the_offsets_out():
    t, lora = table(), comfy_lora()
    kohya = lf.convert(lora, t, "kohya")
    assert sorted(kohya.left_out) == ["diffusion_model.blocks.0.proj.diff_b", "diffusion_model.norm.diff"]
    assert kohya.tensors["lora_unet_conv.lora_down.weight"].shape == (2, 2, 3, 3)  # conv: 4-D, as kohya stores it
    assert kohya.tensors["lora_unet_conv.lora_up.weight"].shape == (4, 2, 1, 1)
    assert float(kohya.tensors["lora_unet_blocks_0_qkv.alpha"]) == 3.0
    assert all(k.startswith("lora_unet_") for k in kohya.tensors)
    back = lf.convert(kohya.tensors, t, "comfyui")
    without_offsets = {k: v for k, v in lora.items() if not k.endswith(("diff", "diff_b"))}
    assert back.tensors.keys() == without_offsets.keys() and not back.left_out
    assert all(torch.equal(back.tensors[k], v) for k, v in without_offsets.items())


def test_comfyui_keeps_everything_and_converting_to_itself_changes_nothing():
    lora = comfy_lora()
    same = lf.convert(lora, table(), "comfyui")
    assert same.tensors.keys() == lora.keys() and not same.left_out
    assert all(torch.equal(same.tensors[k], v) for k, v in lora.items())


def test_diffusers_splits_the_fused_qkv_exactly_with_the_scale_in_the_up_matrices():
    t, lora = table(), comfy_lora(rank=2, alpha=3.0)
    out = lf.convert(lora, t, "diffusers").tensors
    assert not any(k.endswith(".alpha") for k in out)
    up, down = lora[f"diffusion_model.blocks.0.qkv.{UP}"], lora[f"diffusion_model.blocks.0.qkv.{DOWN}"]
    for i, p in enumerate("qkv"):
        assert torch.equal(out[f"transformer.blocks.0.attn.to_{p}.lora_A.weight"], down)
        assert torch.allclose(out[f"transformer.blocks.0.attn.to_{p}.lora_B.weight"], up[4 * i:4 * i + 4] * 1.5)
    assert out["transformer.conv_in.lora_A.weight"].shape == (2, 2, 3, 3)
    out = load(save(out))  # a file can hold it: no two tensors share memory
    expected, got = comfy_deltas(lora), diffusers_deltas(out)
    assert expected.keys() == got.keys()
    for w in expected:
        assert torch.allclose(got[w], expected[w], atol=1e-5), w


def test_diffusers_back_to_comfyui_fuses_the_projections_into_one_down_matrix():
    t, lora = table(), comfy_lora()
    back = lf.convert(lf.convert(lora, t, "diffusers").tensors, t, "comfyui").tensors
    assert back[f"diffusion_model.blocks.0.qkv.{DOWN}"].shape == (2, 4), "the shared down matrix, rank kept"
    assert float(back[f"diffusion_model.blocks.0.qkv.{ALPHA}"]) == 2.0, "scale 1: alpha = rank"
    expected, got = comfy_deltas(lora), comfy_deltas(back)
    for w in expected:
        assert torch.allclose(got[w], expected[w], atol=1e-5), w


def test_independent_projection_loras_fuse_block_diagonally():
    """A file trained by another tool: each projection with its own down matrix and rank."""
    g = torch.Generator().manual_seed(3)
    peft = {}
    for p, rank in zip("qkv", (1, 2, 3)):
        peft[f"transformer.blocks.0.attn.to_{p}.lora_A.weight"] = torch.randn(rank, 4, generator=g)
        peft[f"transformer.blocks.0.attn.to_{p}.lora_B.weight"] = torch.randn(4, rank, generator=g)
    fused = lf.convert(peft, table(), "comfyui").tensors
    assert fused[f"diffusion_model.blocks.0.qkv.{DOWN}"].shape == (6, 4)
    assert torch.allclose(comfy_deltas(fused)["diffusion_model.blocks.0.qkv.weight"],
                          diffusers_deltas(peft)["diffusion_model.blocks.0.qkv.weight"], atol=1e-6)


def test_kohya_alpha_reaches_diffusers_and_a_missing_alpha_means_scale_one():
    t = table()
    lora = {f"lora_unet_blocks_0_proj.{UP}": torch.ones(4, 2), f"lora_unet_blocks_0_proj.{DOWN}": torch.ones(2, 4),
            "lora_unet_blocks_0_proj.alpha": torch.tensor(1.0)}
    out = lf.convert(lora, t, "diffusers").tensors
    assert torch.equal(out["transformer.blocks.0.proj_out.lora_B.weight"], torch.full((4, 2), 0.5))
    del lora["lora_unet_blocks_0_proj.alpha"]
    kohya = lf.convert(lora, t, "kohya").tensors
    assert float(kohya["lora_unet_blocks_0_proj.alpha"]) == 2.0


def test_unet_names_use_diffusers_attention_processor_layout():
    """For SD UNets ComfyUI reads diffusers' names only in the attention-processor layout; diffusers converts it."""
    weight = "diffusion_model.blocks.0.proj.weight"
    t = NameTable({"unet.down_blocks.0.attn1.processor.to_out": Target(weight),
                   "unet.down_blocks.0.proj_in": Target("diffusion_model.conv.weight"),
                   "diffusion_model.blocks.0.proj": Target(weight), "diffusion_model.conv": Target("diffusion_model.conv.weight")},
                  SHAPES, "SD15")
    lora = {k: v for k, v in comfy_lora().items() if k.startswith(("diffusion_model.blocks.0.proj.", "diffusion_model.conv."))}
    out = lf.convert(lora, t, "diffusers").tensors
    assert sorted(out) == ["unet.down_blocks.0.attn1.processor.to_out_lora.down.weight",
                           "unet.down_blocks.0.attn1.processor.to_out_lora.up.weight",
                           "unet.down_blocks.0.proj_in.lora.down.weight", "unet.down_blocks.0.proj_in.lora.up.weight"]
    back = lf.convert(out, t, "comfyui").tensors
    assert torch.allclose(comfy_deltas(back)[weight], comfy_deltas(lora)[weight], atol=1e-6)
    assert lf.detect_format(out, t) == "diffusers" and lf.detect_format(lora, t) == "comfyui"


def test_every_key_layout_comfyui_reads_is_read():
    t, up, down = table(), torch.randn(4, 2), torch.randn(2, 4)
    for up_key, down_key in ((UP, DOWN), ("lora_B.weight", "lora_A.weight"), ("lora.up.weight", "lora.down.weight"),
                             ("lora_linear_layer.up.weight", "lora_linear_layer.down.weight"), ("lora_B", "lora_A")):
        out = lf.convert({f"transformer.blocks.0.proj_out.{up_key}": up,
                          f"transformer.blocks.0.proj_out.{down_key}": down}, t, "comfyui").tensors
        assert torch.equal(out[f"diffusion_model.blocks.0.proj.{UP}"], up), up_key


def test_other_adapters_keep_their_keys_in_kohya_and_are_refused_by_diffusers():
    t = table()
    loha = {f"diffusion_model.blocks.0.proj.{k}": torch.randn(4, 2) for k in ("hada_w1_a", "hada_w1_b",
                                                                             "hada_w2_a", "hada_w2_b")}
    loha["diffusion_model.blocks.0.proj.alpha"] = torch.tensor(2.0)
    kohya = lf.convert(loha, t, "kohya").tensors
    assert sorted(kohya) == sorted(k.replace("diffusion_model.blocks.0.proj.", "lora_unet_blocks_0_proj.") for k in loha)
    with pytest.raises(LoraFormatError, match="diffusers format holds LoRA matrices only.*hada_w1_a.*kohya or comfyui"):
        lf.convert(loha, t, "diffusers")


@pytest.mark.parametrize("lora,message", [
    ({"lora_unet_nowhere.lora_up.weight": torch.ones(1, 1)}, "1 keys of the LoRA name no module ComfyUI knows in this "
                                                            "Flux model: lora_unet_nowhere.lora_up.weight. Give the model"),
    ({f"diffusion_model.blocks.0.proj.{UP}": torch.ones(8, 2), f"diffusion_model.blocks.0.proj.{DOWN}": torch.ones(2, 4)},
     r"diffusion_model.blocks.0.proj has matrices \(8, 2\) and \(2, 4\), which do not fit the model's weight \(4, 4\)"),
    ({f"diffusion_model.blocks.0.proj.{UP}": torch.ones(4, 2)}, "only one of its two matrices"),
])
def test_a_file_that_does_not_fit_the_model_is_refused_with_what_to_do(lora, message):
    with pytest.raises(LoraFormatError, match=message):
        lf.convert(lora, table(), "kohya")


def test_families_diffusers_does_not_have_are_refused_and_unknown_formats_named():
    with pytest.raises(LoraFormatError, match="diffusers has no LoRA layout ComfyUI knows for WAN21_T2V models.*kohya"):
        lf.convert(comfy_lora(), table("WAN21_T2V"), "diffusers")
    with pytest.raises(LoraFormatError, match="unknown LoRA format 'peft'; choose one of comfyui, kohya, diffusers"):
        lf.convert(comfy_lora(), table(), "peft")


def test_a_file_records_its_format_and_older_files_are_comfyui(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(1)}, str(tmp_path / "old.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "k.safetensors"), metadata={lf.FORMAT_METADATA_KEY: "kohya"})
    assert lf.file_format(str(tmp_path / "old.safetensors")) == "comfyui"
    assert lf.file_format(str(tmp_path / "k.safetensors")) == "kohya"
    assert lf.file_format(str(tmp_path / "none.safetensors")) is None


def test_dora_magnitudes_go_to_kohya_beside_their_matrices_and_back_and_diffusers_refuses_them():
    t = table()
    dora = dict(comfy_lora())
    magnitude = torch.rand(1, 4) + 0.5
    dora["diffusion_model.blocks.0.proj.dora_scale"] = magnitude
    kohya = lf.convert(dora, t, "kohya").tensors
    assert torch.equal(kohya["lora_unet_blocks_0_proj.dora_scale"], magnitude)
    back = lf.convert(kohya, t, "comfyui").tensors
    assert torch.equal(back["diffusion_model.blocks.0.proj.dora_scale"], magnitude)
    with pytest.raises(LoraFormatError, match="diffusers format holds LoRA matrices only.*dora_scale.*DoRA"):
        lf.convert(dora, t, "diffusers")
