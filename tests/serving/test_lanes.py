"""A model whose batches run in lanes (two here, on one CPU) takes `max_batch` rows per lane, and many requests at
once, some joining while others run, get the answers of generating alone."""

import pytest

from devmap.serving import EngineLimits, ModelRegistry

from .lane_checks import served_and_alone


@pytest.mark.parametrize("riding", [False, True], ids=["own prefills", "riding joiners"])
def test_requests_over_two_lanes_get_the_answers_of_generating_alone(model_root, riding):
    limits = EngineLimits(max_batch=4, lanes=2, compile=False, riding=riding)
    registry = ModelRegistry(model_root, "auto", "cpu=2GB", limits=limits)
    resident = registry.load(model_root / "tiny")
    assert resident.lanes == 2 and resident.max_rows == 8 and resident.describe()["lanes"] == 2
    for served, alone in served_and_alone(registry, limits, "tiny", 7):
        assert served == alone
    assert resident.batch_shape.rows == 8  # two lanes of max_batch rows
