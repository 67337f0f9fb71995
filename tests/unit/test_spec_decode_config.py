"""The speculative_config option and the n-gram proposer."""

from __future__ import annotations

import pytest

from moeserve.engine_config import EngineConfig
from moeserve.spec_decode import SpeculativeConfig, propose_ngram


def test_the_option_takes_a_dict_or_the_flags_json():
    config = EngineConfig.from_options(
        device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert config.speculative_config == SpeculativeConfig("ngram", 2, prompt_lookup_max=3)
    text = '{"method": "ngram", "num_speculative_tokens": 4}'
    flag = EngineConfig.from_options(device="cpu", speculative_config=text)
    assert flag.speculative_config == SpeculativeConfig("ngram", 4)
    assert EngineConfig(device="cpu").speculative_config is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 1}, "methods are: ngram, mtp"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) draft_model"),
        ("{not json", "not JSON"),
    ],
)
def test_what_does_not_apply_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineConfig(device="cpu", speculative_config=value)
    assert message in str(info.value)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [4, 5]  # [1, 2, 3] last seen before 4, 5
    assert propose_ngram(tokens, 5, 1, 3) == [4, 5, 1, 2, 3]
    assert propose_ngram([7, 8, 9], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([5, 6, 5, 7, 5], 2, 2, 3) == []  # only a 1-gram matches, below min
    assert propose_ngram([5, 6, 5, 7, 5], 2, 1, 3) == [7, 5]
