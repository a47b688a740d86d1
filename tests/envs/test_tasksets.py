"""Built-in tasksets: deterministic generation, disjoint splits, rewards through verifiers' scoring."""

from __future__ import annotations

import asyncio

import pytest
import verifiers.v1 as vf
from verifiers.v1.trace import AgentInfo, TraceTask

from jaxrl.envs.alphabet_sort import AlphabetSortConfig, AlphabetSortTaskset, parse_names
from jaxrl.envs.common import draw_split, similarity, split_of
from jaxrl.envs.lookup import LookupConfig, LookupTaskset, code, lookup, reference_conversation
from jaxrl.envs.needle import NeedleConfig, NeedleTaskset
from jaxrl.envs.reverse_text import ReverseTextConfig, ReverseTextTaskset

TASKSETS = {
    "reverse_text": (ReverseTextTaskset, ReverseTextConfig),
    "alphabet_sort": (AlphabetSortTaskset, AlphabetSortConfig),
    "lookup": (LookupTaskset, LookupConfig),
    "needle": (NeedleTaskset, NeedleConfig),
}


def load(name: str, **kw) -> list:
    taskset_cls, config_cls = TASKSETS[name]
    return list(taskset_cls(config_cls(**kw)))


def wire(tasks) -> list[dict]:
    return [t.data.model_dump(mode="json") for t in tasks]


def score(task, *turns: tuple[str, str], tool_outputs: tuple[str, ...] = ()) -> vf.Trace:
    """A trace of alternating (user, assistant) turns (plus lookup tool outputs), scored."""
    nodes = []
    for user, reply in turns:
        nodes.append(
            vf.MessageNode(parent=len(nodes) - 1 if nodes else None, message=vf.UserMessage(content=user))
        )
        nodes.append(
            vf.MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content=reply), sampled=True)
        )
    for i, out in enumerate(tool_outputs):
        message = vf.ToolMessage(tool_call_id=f"c{i}", name="lookup", content=out)
        nodes.insert(1, vf.MessageNode(parent=0, message=message))
    trace = vf.Trace(
        task=TraceTask(type="t", data=task.data), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes
    )
    asyncio.run(task.score(trace))
    return trace


@pytest.mark.parametrize("name", sorted(TASKSETS))
def test_generation_is_deterministic_and_seeded(name):
    first = wire(load(name, num_tasks=20, seed=3))
    assert first == wire(load(name, num_tasks=20, seed=3))
    assert first != wire(load(name, num_tasks=20, seed=4))
    assert [t["idx"] for t in first] == list(range(20))
    assert len({t["prompt"] for t in first}) == 20


@pytest.mark.parametrize("name", sorted(TASKSETS))
def test_eval_split_is_held_out(name):
    train = {t["prompt"] for t in wire(load(name, num_tasks=300, seed=0))}
    evals = {t["prompt"] for t in wire(load(name, split="eval", num_tasks=30, seed=5))}
    assert len(evals) == 30 and not train & evals


@pytest.mark.parametrize("name", sorted(TASKSETS))
def test_default_sizes(name):
    assert len(load(name)) == 1000
    assert len(load(name, split="eval")) == 100


def test_split_is_a_function_of_content():
    keys = [f"k{i}" for i in range(2000)]
    share = sum(split_of(k) == "eval" for k in keys) / len(keys)
    assert 0.05 < share < 0.15
    assert [split_of(k) for k in keys] == [split_of(k) for k in keys]


def test_too_small_item_space_is_a_clear_error():
    with pytest.raises(ValueError, match="could only draw 1 distinct train tasks"):
        draw_split(
            lambda rng: "same",
            lambda t: t,
            split=split_of("same"),
            num=2,
            seed=0,
            name="x",
            max_draws_per_item=5,
        )


def test_reverse_text_reward():
    task = load("reverse_text", num_tasks=1)[0]
    assert task.data.answer == task.data.prompt[::-1]
    assert score(task, ("q", task.data.answer)).reward == 1.0
    assert score(task, ("q", "")).reward == 0.0
    partial = score(task, ("q", task.data.answer[:-1])).reward
    assert partial == pytest.approx(similarity(task.data.answer[:-1], task.data.answer)) and 0 < partial < 1


def test_needle_buries_its_facts_at_seeded_depths_and_rewards_each_answer():
    tasks = load("needle", num_tasks=30, context_words=200, seed=1)
    depths = set()
    for task in tasks:
        document, asked = task.data.prompt.split("\n\n")
        (key,), (code,) = task.data.keys, task.data.answers
        assert asked == f"What is the code for {key}?"
        needle = f"The code for {key} is {code}."
        assert document.count("The code for") == 1 and needle in document
        assert len(document.split()) == 200 + len(needle.split())
        depths.add(document.split().index("The"))
    assert len(depths) > 10  # the needle moves through the document
    task = tasks[0]
    assert score(task, ("q", task.data.answers[0])).reward == 1.0
    assert score(task, ("q", f" {task.data.answers[0]}\n")).reward == 1.0
    assert score(task, ("q", "")).reward == 0.0
    three = load("needle", num_tasks=5, context_words=100, questions=3)[0]
    assert len(set(three.data.keys)) == 3 and three.data.prompt.count("The code for") == 3
    a, b, c = three.data.answers
    assert score(three, ("q", a), (f"What is the code for {three.data.keys[1]}?", b), ("q", c)).reward == 1.0
    assert score(three, ("q", a)).reward == pytest.approx(1 / 3)  # unanswered questions score 0


def test_alphabet_sort_rewards_every_turn():
    tasks = load("alphabet_sort", num_tasks=50, min_turns=3, max_turns=3, first_names=2, names_per_turn=1)
    task = tasks[0]
    assert [len(t) for t in task.data.turns] == [2, 1, 1]
    expected = task.data.expected()
    assert expected[-1] == sorted(name for turn in task.data.turns for name in turn)
    perfect = [(f"u{i}", "\n".join(e)) for i, e in enumerate(expected)]
    trace = score(task, *perfect)
    assert trace.reward == 1.0 and trace.metrics["turns_correct"] == 1.0
    trace = score(task, *perfect[:2])  # the last turn never answered
    assert trace.reward == pytest.approx(2 / 3) and trace.metrics["turns_correct"] == pytest.approx(2 / 3)
    wrong_order = [(u, "\n".join(reversed(r.splitlines()))) for u, r in perfect]
    assert score(task, *wrong_order).metrics["turns_correct"] == 0.0
    assert parse_names(" Bob \n\nAlice\n") == ["Bob", "Alice"]


def test_lookup_tool_and_rewards():
    assert lookup("apple") == "bqqmf" and lookup("Zoo") == "app"
    task = next(t for t in load("lookup", num_tasks=50, max_keys=2) if len(t.data.keys) == 2)
    codes = [lookup(k) for k in task.data.keys]
    assert task.data.answer == " ".join(codes) and task.data.tools == ["jaxrl.envs.lookup:lookup"]
    assert score(task, ("q", task.data.answer), tool_outputs=tuple(codes)).reward == pytest.approx(1.0)
    assert score(task, ("q", task.data.answer)).reward == pytest.approx(0.75)  # answered without looking up
    half = score(task, ("q", "nope"), tool_outputs=(codes[0],))
    assert half.rewards["looked_up"].score == 0.5


def test_lookup_alphabet_and_lengths():
    tasks = load("lookup", num_tasks=100, min_len=4, max_len=4, alphabet_size=6)
    keys = [k for t in tasks for k in t.data.keys]
    assert {len(k) for k in keys} == {4} and set("".join(keys)) == set("abcdef")  # all six letters, no others
    # the code is still the shift along the full alphabet: 'f' -> 'g', outside the key letters
    assert all(t.data.answer == lookup(t.data.keys[0]) for t in tasks) and "g" in "".join(t.data.answer for t in tasks)
    for bad, match in (({"alphabet_size": 27}, "alphabet_size"), ({"alphabet_size": 1}, "alphabet_size"),
                       ({"shifts": 0}, "shifts"), ({"shifts": 26}, "shifts"),
                       ({"min_len": 5, "max_len": 4}, "max_len=4 < min_len=5; set max_len >= min_len")):
        with pytest.raises(ValueError, match=match):
            LookupConfig(**bad)


def test_lookup_hidden_shifts_make_the_answer_need_the_tool():
    plain = wire(load("lookup", num_tasks=60, seed=1))
    assert plain == wire(load("lookup", num_tasks=60, seed=1, shifts=1))  # the default keeps its tasks
    tasks = load("lookup", num_tasks=200, seed=1, shifts=4, min_len=4, max_len=4, alphabet_size=6)
    assert {t.data.shift for t in tasks} == {1, 2, 3, 4}
    for t in tasks:
        assert t.data.answer == code(t.data.keys[0], t.data.shift)
        assert not any(ch.isdigit() for ch in t.data.prompt + t.data.system_prompt)  # the shift stays hidden
    task = next(t for t in tasks if t.data.shift == 3)
    assert code("xyz", 3) == "abc" and task.data.tools == ["jaxrl.envs.lookup:lookup_shift3"]
    # the tool the harness resolves applies the task's shift and is offered to the model as `lookup`
    from verifiers.v1.utils.loaders import plugged_fn

    tool = plugged_fn(task.data.tools[0])
    assert tool.__name__ == "lookup" and tool(task.data.keys[0]) == task.data.answer != lookup(task.data.keys[0])
    # the SFT reference episode shows the task's own tool output; the rewards check against it
    messages, specs = reference_conversation(task.data)
    assert [m["content"] for m in messages if m["role"] == "tool"] == [task.data.answer]
    assert specs[0]["function"]["name"] == "lookup"
    assert score(task, ("q", task.data.answer), tool_outputs=(task.data.answer,)).reward == pytest.approx(1.0)
    wrong_tool = score(task, ("q", task.data.answer), tool_outputs=(lookup(task.data.keys[0]),))
    assert wrong_tool.rewards["looked_up"].score == 0.0
