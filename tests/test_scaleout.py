"""`qwenrt serve --ray` without Ray: the prefix-affinity policy (qwenrt.scaleout.affinity) and the options."""

import json
import random

import pytest

from qwenrt.scaleout.affinity import BLOCK_CHARS, Recent, by_affinity, prompt_prefix
from tests.hostile import one_line_error

SYSTEM = {"role": "system", "content": "You are terse. " * 10}


def chat(*messages, **fields) -> bytes:
    return json.dumps({"model": "m", "messages": [SYSTEM, *messages], **fields}).encode()


def test_a_next_turn_shares_the_earlier_turns_and_nothing_else_does():
    turn1 = prompt_prefix("/v1/chat/completions", chat({"role": "user", "content": "2+3?"}))
    turn2 = prompt_prefix("/v1/chat/completions", chat({"role": "user", "content": "2+3?"}, {
        "role": "assistant", "content": "5"}, {"role": "user", "content": "+1?"}))
    other = prompt_prefix("/v1/chat/completions", chat({"role": "user", "content": "3+3?"}))
    tools = prompt_prefix("/v1/chat/completions", chat({"role": "user", "content": "2+3?"}, tools=[{"x": 1}]))
    seen = Recent()
    seen.add(turn1)
    assert seen.shared(turn2) == turn1.length and turn1.length < turn2.length
    assert seen.shared(other) == turn1.ends[1]  # the model and the system message, not the user's
    assert seen.shared(tools) == 0  # tools change the prompt from its start
    assert prompt_prefix("/v1/chat/completions", b"{not json").length == 0
    assert prompt_prefix("/v1/models", b"").length == 0


def test_a_completion_prompt_matches_in_whole_blocks():
    text = "x" * (3 * BLOCK_CHARS + 10)
    seen = Recent()
    seen.add(prompt_prefix("/v1/completions", json.dumps({"prompt": text}).encode()))
    longer = prompt_prefix("/v1/completions", json.dumps({"prompt": text + "yz"}).encode())
    assert seen.shared(longer) == longer.ends[3]  # the model/tools piece and three whole blocks


def test_affinity_holds_while_loads_are_close_and_yields_to_power_of_two_past_the_imbalance():
    rng = random.Random(0)
    prefix = prompt_prefix("/v1/chat/completions", chat({"role": "user", "content": "2+3?"}))
    home, away, third = Recent(), Recent(), Recent()
    home.add(prefix)
    recent = {"a": home, "b": away, "c": third}
    assert by_affinity(["a", "b", "c"], prefix, recent, {"a": 4, "b": 0, "c": 1}, rng=rng)[0] == ["a"]
    fallback = by_affinity(["a", "b", "c"], prefix, recent, {"a": 5, "b": 0}, imbalance=4, rng=rng)
    assert len(fallback) == 1 and len(fallback[0]) == 2
    unseen = prompt_prefix("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}
                                                              ).encode())
    assert len(by_affinity(["a", "b", "c"], unseen, recent, {}, rng=rng)[0]) == 2  # nobody shares it: pow2


@pytest.mark.parametrize("options, named", [(["--replicas", "2"], "--replicas"),
                                            (["--ray-address", "auto", "--routing", "pow2"], "--ray-address, --routing")])
def test_ray_options_need_ray(options, named):
    from qwenrt.cli import build_parser
    from qwenrt.server.main import serve

    one_line_error(lambda: serve(build_parser().parse_args(["serve", *options])), f"{named}: only with --ray")


@pytest.mark.parametrize("text, bounds", [("3", (3, 3)), ("1:4", (1, 4))])
def test_replicas_fixed_or_autoscaled(text, bounds):
    """--replicas N is that many; MIN:MAX gives Serve an autoscaling range whose target is the engine's batch."""
    from qwenrt.cli import build_parser
    from qwenrt.scaleout.ray_app import _scaling

    args = build_parser().parse_args(["serve", "--ray", "--replicas", text, "--max-running", "6"])
    assert args.replicas == bounds
    scaling = _scaling(args.replicas, vars(args))
    if bounds[0] == bounds[1]:
        assert scaling == {"num_replicas": 3}
    else:
        auto = scaling["autoscaling_config"]
        assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 6)


@pytest.mark.parametrize("text", ["0", "4:2", "x", "1:"])
def test_bad_replica_counts(text, capsys):
    from qwenrt.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ray", "--replicas", text])
    assert "--replicas" in capsys.readouterr().err
