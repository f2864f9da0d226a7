"""Which checkpoint layouts store which weight formats: declared once per layout (``Layout.weight_formats``) and
queried with ``lowbit.io.layouts.layouts_storing``; a layout's refusals agree with what it declares (CPU only)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.formats import REGISTRY
from lowbit.io.layouts import LAYOUTS, layouts_storing
from lowbit.nn import SCHEMES


def _layer(scheme: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128))
    return lowbit.quantize_model(model, scheme, skip=())[0]


@pytest.fixture(scope="module")
def layers():
    return {name: _layer(name) for name in SCHEMES}


def test_every_declared_format_is_registered():
    for name, lay in LAYOUTS.items():
        assert lay.weight_formats, name
        assert set(lay.weight_formats) <= set(REGISTRY), (name, lay.weight_formats)
    assert layouts_storing("nf4") == ("bitsandbytes", "lowbit")
    assert "compressed-tensors" in layouts_storing("nvfp4") and "modelopt" in layouts_storing("nvfp4")
    assert layouts_storing("fp4_b32") == ("lowbit",)
    assert layouts_storing("no-such-format") == ()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_layout_stores_a_layer_only_if_it_declares_its_weight_format(layers, scheme):
    m = layers[scheme]
    fmt = SCHEMES[scheme].weight_format
    for name, lay in LAYOUTS.items():
        why = lay.unsupported(m)
        if fmt not in lay.weight_formats:
            assert why is not None, f"{name} stores {scheme} but does not declare {fmt}"
    # the layout save_quantized(format="auto") picks for the scheme declares its weight format and takes the layer
    auto = LAYOUTS[SCHEMES[scheme].checkpoint]
    assert fmt in auto.weight_formats and auto.unsupported(m) is None, (scheme, auto.name)


def test_a_format_registered_later_is_stored_by_the_native_layout():
    assert set(LAYOUTS["lowbit"].weight_formats) == set(REGISTRY)
    assert "lowbit" in layouts_storing("int4_awq")


def test_a_declared_format_can_still_be_refused_for_its_activations(layers):
    # LightX2V's nvfp4 layers quantize activations too: it declares nvfp4 and refuses the weight-only scheme
    lay = LAYOUTS["lightx2v"]
    assert "nvfp4" in lay.weight_formats
    assert lay.unsupported(layers["w4a4-nvfp4"]) is None
    assert "activations" in lay.unsupported(layers["w4a16-nvfp4"])
