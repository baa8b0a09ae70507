"""tools/compat/sglang_compat.py reports a step as "SGLang-side" only when SGLang's processor read an attribute that
none of its classes defines or sets (no checkpoint could provide it); every other failure stays a failure."""

from __future__ import annotations

import pytest

from tests.support.sglang_side import sglang_missing_attribute


class SharedBase:
    """Like SGLang's base processor: a shared `get_mm_data` reading attributes each model's processor sets."""

    def get_mm_data(self, prompt):
        return [self.IM_TOKEN_ID] * len(prompt), self.IM_START_TOKEN_ID


class NeverSets(SharedBase):
    """Like SGLang 0.5.23's Dots3-Note processor: its constructor sets other names, never the ones read."""

    def __init__(self):
        self.mm_token_ids = {"im_start_id": 5}
        self.IM_TOKEN_ID = 7


class SetsInItsConstructor(SharedBase):
    """Sets what `get_mm_data` reads: made without its constructor, the error is the caller's, not SGLang's."""

    def __init__(self):
        self.IM_TOKEN_ID, self.IM_START_TOKEN_ID = 7, 5


class SetsThroughSetattr(SharedBase):
    def __init__(self, **tokens):
        for name, value in tokens.items():
            setattr(self, name, value)


def failure(processor) -> BaseException:
    with pytest.raises(Exception) as caught:
        processor.get_mm_data("ab")
    return caught.value


def test_an_attribute_no_class_sets_is_sglang_side_and_says_where_it_is_read():
    processor = NeverSets()
    reason = sglang_missing_attribute(processor, failure(processor))
    line = SharedBase.get_mm_data.__code__.co_firstlineno + 1
    assert reason is not None
    assert "NeverSets uses SharedBase.get_mm_data, which reads self.IM_START_TOKEN_ID at " in reason
    assert f"test_sglang_side_defects.py:{line};" in reason
    assert "none of NeverSets, SharedBase defines or sets it" in reason


def test_an_attribute_some_constructor_sets_is_not_sglang_side():
    for cls in (SetsInItsConstructor, SetsThroughSetattr, NeverSets):
        processor = cls.__new__(cls)  # IM_TOKEN_ID missing: NeverSets' constructor would have set it
        assert sglang_missing_attribute(processor, failure(processor)) is None, cls.__name__


def test_other_failures_are_not_sglang_side():
    processor = NeverSets()
    assert sglang_missing_attribute(processor, RuntimeError("5 placeholders for 6 rows")) is None
    assert sglang_missing_attribute(processor, AttributeError("no name")) is None
    other = NeverSets()
    assert sglang_missing_attribute(processor, failure(other)) is None  # read on another object
