"""The tiny Qwen3 checkpoint, tokenizer and engine configs shared by the engine, serving and rollout tests."""

from engine_fixtures import *  # the fixtures, found by name
