import pytest

from optimum_neuronx.buckets import context_bucket, token_bucket
from optimum_neuronx.configuration import default_buckets


@pytest.mark.parametrize("sequence_length, expected", [
    (64, (64,)), (128, (128,)), (300, (128, 256, 300)), (1024, (128, 256, 512, 1024)),
])
def test_default_buckets(sequence_length, expected):
    assert default_buckets(sequence_length) == expected


@pytest.mark.parametrize("length, expected", [(1, 16), (16, 16), (17, 64), (64, 64)])
def test_context_bucket_is_smallest_that_fits(length, expected):
    assert context_bucket(length, (16, 64)) == expected


def test_context_bucket_too_long():
    with pytest.raises(ValueError, match="65 tokens but the largest compiled context-encoding bucket is 64"):
        context_bucket(65, (16, 64))


@pytest.mark.parametrize("position, expected", [(0, 32), (31, 32), (32, 64), (63, 64)])
def test_token_bucket_holds_the_written_slot(position, expected):
    assert token_bucket(position, (32, 64)) == expected


def test_token_bucket_past_cache_end():
    with pytest.raises(ValueError, match="position 64: the compiled sequence_length .* is 64"):
        token_bucket(64, (32, 64))
