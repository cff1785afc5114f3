"""Fixtures of the reference tests."""

import pytest

from dsv41_decode.config import ModelConfig


@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return ModelConfig.preset("v41-flash")
