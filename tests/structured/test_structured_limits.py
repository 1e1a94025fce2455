"""A constraint is honoured or refused: one beyond the grammar engine's limits is refused at
compile time (naming the limit), a ``$ref`` cycle by name, and a matcher that runs out of a
limit mid-generation fails its request instead of ending it as "stop"."""

from __future__ import annotations

import os

import pytest

from kvserve.models.loader import default_model_path
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams as S
from kvserve.structured.limits import check_ref_cycles
from kvserve.structured.manager import StructuredOutputManager
from kvserve.tokenizer import Tokenizer
from tests.structured.test_structured_unit import _sched

CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
TREE = {  # recursive through a property: fine
    "$ref": "#/$defs/node",
    "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
}


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    path = default_model_path()
    tokenizer = Tokenizer.from_loaded(os.path.dirname(path), os.path.basename(path))
    return StructuredOutputManager(tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (S(regex="(.{1,1000}){1,1000}"), "lexer fuel"),
        (S(regex="^(a{1000}){1000}$"), "lexer fuel"),
        (S(json=CYCLE), "#/$defs/a -> #/$defs/b -> #/$defs/a"),
        (S(json={"$ref": "#"}), "$ref cycle # -> #"),
    ],
)
def test_a_constraint_beyond_the_limits_is_refused_naming_why(
    manager: StructuredOutputManager, spec: S, needle: str
) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind}") as info:
        manager.validate(spec)
    assert needle in str(info.value)


def test_constraints_within_the_limits_compile(manager: StructuredOutputManager) -> None:
    for spec in (S(json=TREE), S(regex="a{5000}"), S(regex=r"\w{1,200}( \w{1,200}){0,50}")):
        manager.validate(spec)
    check_ref_cycles({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}})


class _OutOfFuel:
    """A matcher stand-in stopped by a limit of the grammar engine (as llguidance's is once
    its lexer runs out of fuel mid-generation: in an error state, and stopped)."""

    def is_error(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return True

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed\n<state>..."

    def consume_token(self, token_id: int) -> bool:
        return False


def test_a_matcher_out_of_a_limit_mid_generation_fails_its_request(
    manager: StructuredOutputManager,
) -> None:
    spec = S(choice=["yes", "no"])
    reqs = [Request(f"lim{i}", [1, 2], SamplingParams(structured_outputs=spec)) for i in range(3)]
    manager.add_request([r.request_id for r in reqs], spec)
    manager._states["lim1"].matcher = _OutOfFuel()
    sched = _sched(reqs)
    faults = manager.prepare(sched, {r.request_id: r for r in reqs}.get)
    assert list(faults) == ["lim1"] and "lexer fuel" in faults["lim1"]
    assert sched.grammar_bitmask is not None
    assert sched.grammar_bitmask.request_ids == ["lim0", "lim2"]  # no EOS-only row for it
    # After a sampled token: failed, not ended ("stop").
    manager._states["lim2"].matcher = _OutOfFuel()
    reqs[2].output_token_ids.append(5)
    ended, update_faults = manager.update([reqs[0], reqs[2]])
    assert ended == [] and list(update_faults) == ["lim2"]
    assert "lexer fuel" in update_faults["lim2"]
    for r in reqs:
        manager.free(r.request_id)
