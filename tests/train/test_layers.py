"""Which layers a LoRA trains (``streaming_cache.train.layers``): the presets on the module names of ComfyUI's model
classes, the filter and the ranks per block group. Every family's real names are checked in the family sweep
(``tests/comfy/test_families.py``); what the files hold after training, in ``tests/comfy/test_trainer.py``."""

from __future__ import annotations

import pytest

from streaming_cache.train import layers
from streaming_cache.train.layers import LayerChoice, layer_kind

# (ComfyUI's module name, kind): SD1.x/SDXL UNet, Flux double and single blocks, SD3, Wan, Qwen-Image, Lumina /
# Z-Image, LTX-Video, HunyuanVideo.
NAMES = [
    ("input_blocks.1.1.transformer_blocks.0.attn1.to_q", "attention"),
    ("input_blocks.1.1.transformer_blocks.0.attn2.to_out.0", "attention"),
    ("input_blocks.1.1.transformer_blocks.0.ff.net.0.proj", "mlp"),
    ("input_blocks.1.1.proj_in", "other"),
    ("input_blocks.1.0.in_layers.2", "other"),
    ("time_embed.0", "other"),
    ("double_blocks.0.img_attn.qkv", "attention"),
    ("double_blocks.0.txt_attn.proj", "attention"),
    ("double_blocks.0.img_mlp.0", "mlp"),
    ("double_blocks.0.img_mod.lin", "other"),
    ("single_blocks.3.linear1", "attention"),
    ("single_blocks.3.linear2", "attention"),
    ("single_blocks.3.modulation.lin", "other"),
    ("joint_blocks.2.x_block.attn.qkv", "attention"),
    ("joint_blocks.2.x_block.mlp.fc1", "mlp"),
    ("blocks.4.self_attn.q", "attention"),
    ("blocks.4.cross_attn.k", "attention"),
    ("blocks.4.ffn.0", "mlp"),
    ("transformer_blocks.1.attn.add_q_proj", "attention"),
    ("transformer_blocks.1.img_mlp.net.0.proj", "mlp"),
    ("layers.2.attention.qkv", "attention"),
    ("layers.2.feed_forward.w1", "mlp"),
    ("img_in", "other"),
    ("final_layer.linear", "other"),
]


@pytest.mark.parametrize("name,kind", NAMES)
def test_each_family_s_attention_and_mlp_layers_are_told_apart_by_name(name, kind):
    assert layer_kind(name) == kind


def test_the_presets_choose_nested_sets_and_only_all_trains_offsets():
    matrices = [n for n, _ in NAMES]
    chosen = {p: {n for n in matrices if LayerChoice(p).trains(n, matrix=True)} for p in layers.TARGET_LAYERS}
    assert chosen["all"] == chosen["matrices"] == set(matrices)
    assert chosen["attention_mlp"] == {n for n, k in NAMES if k in ("attention", "mlp")}
    assert chosen["attention"] == {n for n, k in NAMES if k == "attention"}
    offsets = {p: LayerChoice(p).trains("input_blocks.1.1.norm", matrix=False) for p in layers.TARGET_LAYERS}
    assert offsets == {"all": True, "matrices": False, "attention_mlp": False, "attention": False}
    assert not LayerChoice().narrows and all(LayerChoice(p).narrows for p in layers.TARGET_LAYERS[1:])


def test_a_filter_narrows_the_preset_by_pieces_of_names_or_regular_expressions():
    choice = LayerChoice("attention", "double_blocks, re:^single_blocks\\.[0-9]\\.")
    assert choice.trains("double_blocks.0.img_attn.qkv", matrix=True)
    assert choice.trains("single_blocks.3.linear1", matrix=True)
    assert not choice.trains("single_blocks.13.linear1", matrix=True), "the expression asks for blocks 0-9"
    assert not choice.trains("double_blocks.0.img_mlp.0", matrix=True), "the preset still applies"
    assert LayerChoice("all", "attn1\nattn2").trains("input_blocks.1.1.transformer_blocks.0.attn1.norm",
                                                     matrix=False), "with all, a filter keeps matching offsets"


def test_ranks_per_block_group_take_the_first_match_and_zero_leaves_a_layer_out():
    choice = LayerChoice("all", "", "single_blocks=8, re:^double_blocks\\.1[0-9]\\.=0\nblocks=32")
    assert choice.rank("single_blocks.3.linear1", 16) == 8, "first match wins over the later 'blocks'"
    assert choice.rank("double_blocks.2.img_attn.qkv", 16) == 32
    assert choice.rank("img_in", 16) == 16, "no match: the run's rank"
    assert not choice.trains("double_blocks.12.img_attn.qkv", matrix=True)
    assert not choice.trains("double_blocks.12.img_attn.norm.query_norm", matrix=False), "its offsets too"
    assert choice.trains("double_blocks.2.img_attn.qkv", matrix=True)


def test_choosing_no_layer_names_the_settings_and_the_model_s_layers():
    message = LayerChoice("attention", "nothing_here").nothing_chosen([n for n, _ in NAMES])
    assert "'attention'" in message and "'nothing_here'" in message and f"{len(NAMES)} layers" in message
    assert "attention: input_blocks.1.1.transformer_blocks.0.attn1.to_q" in message
    assert "mlp: input_blocks.1.1.transformer_blocks.0.ff.net.0.proj" in message
