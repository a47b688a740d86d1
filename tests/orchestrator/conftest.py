"""Orchestrator test setup: this folder's helper modules importable by name, and the
fixtures of the env-server tests (a tiny tokenizer, a scripted model endpoint, one loop)."""

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # fake_engine.py, scripted.py, trace_builders.py

from fake_engine import FakeEngine
from scripted import policy

from jaxrl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return str(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tokenizer_dir):
    with FakeEngine(tokenizer_dir, policy) as engine:
        yield engine


@pytest.fixture(scope="module")
def endpoint(engine, tokenizer_dir):
    from jaxrl.endpoint import ModelEndpoint

    return ModelEndpoint(base_url=engine.base_url, model=engine.model, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")
