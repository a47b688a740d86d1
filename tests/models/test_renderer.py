"""``[model] renderer``: names checked at config time by renderers' own registry; auto resolution."""

from __future__ import annotations

import pytest
from families import build_family_tokenizer
from transformers import AutoTokenizer

from jaxrl.cli import build_config
from jaxrl.models.renderer import resolve_renderer


def test_unknown_renderer_fails_at_config_time_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"model.renderer = 'llama3' is not a renderer; known: .*'?llama-3") as e:
        build_config({"model": {"name": "some/model", "renderer": "llama3"}}, [])
    assert "qwen3" in str(e.value) and "gpt-oss" in str(e.value)
    with pytest.raises(ValueError, match=r"(?s)renderer_args for renderer 'qwen3'.*enable_thinkin"):
        build_config({"model": {"name": "org/m", "renderer": "qwen3", "renderer_args": {"enable_thinkin": True}}}, [])
    cfg = build_config({}, ["--model.name", "org/m", "--model.renderer", "llama-3", "--model.renderer_args", '{"date_string": "1 Jan 2026"}'])
    assert (cfg.model.renderer, cfg.model.renderer_args) == ("llama-3", {"date_string": "1 Jan 2026"})


def test_auto_resolution(tmp_path) -> None:
    llama = AutoTokenizer.from_pretrained(build_family_tokenizer(tmp_path / "llama3", "llama3"))
    qwen = AutoTokenizer.from_pretrained(build_family_tokenizer(tmp_path / "qwen3", "qwen3"))
    # renderers' own hub-id map first, then config.json's model_type
    assert resolve_renderer("auto", {}, model_name="meta-llama/Llama-3.2-1B-Instruct", hf_config={}, tokenizer=llama)["name"] == "llama-3"
    assert resolve_renderer("auto", {}, model_name="Qwen/Qwen3-0.6B", hf_config={}, tokenizer=qwen) == {
        "name": "qwen3", "enable_thinking": False,
    }  # fmt: skip
    assert resolve_renderer("auto", {"enable_thinking": True}, model_name=None, hf_config={"model_type": "qwen3"},
                            tokenizer=qwen)["enable_thinking"] is True  # fmt: skip
    # model_type "llama" without Llama 3's header tokens (Llama 2): the template verbatim
    assert resolve_renderer("auto", {}, model_name=None, hf_config={"model_type": "llama"}, tokenizer=qwen) == {"name": "default"}
    assert resolve_renderer("auto", {}, model_name=None, hf_config={"model_type": "mistral"}, tokenizer=qwen) == {"name": "default"}
    # an explicit name wins over auto
    assert resolve_renderer("llama-3", {}, model_name="Qwen/Qwen3-0.6B", hf_config={"model_type": "qwen3"},
                            tokenizer=llama)["name"] == "llama-3"  # fmt: skip
    with pytest.raises(ValueError, match="renderer_args for renderer 'llama-3'"):
        resolve_renderer("auto", {"enable_thinking": True}, model_name=None, hf_config={"model_type": "llama"}, tokenizer=llama)
