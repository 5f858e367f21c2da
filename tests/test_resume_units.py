"""The parts of a resumed stream, in this process: the event ids and what a resume skips (router.resume), the
split of a request's outputs so far (router.dispatch), the scheduler's sessions (scheduler.sessions), and the
gateway's answers to resumes it cannot serve (fake replicas)."""
from __future__ import annotations

import asyncio
import itertools

import pytest
import requests

from fake_replicas import FakeRouter
from router.errors import APIError
from router.dispatch import _split
from router.resume import EventIds, ResumePoint, wants_event_ids
from router.submit_stream import ReplicaOutput
from scheduler.connection import Connection
from scheduler.request import RequestOutput
from scheduler.sessions import NotHeld, Sessions, Taken
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import SampledToken, TokenLogprob
from tiny_models import with_word_tokenizer

# -- event ids ----------------------------------------------------------------------------------------------


def _events(delta):
    """A delta's events as the gateway makes them: a choice's first delta opens it, a finishing one closes it
    in an event of its own (so deltas have one, two or three events)."""
    choice, start, end, first, finish = delta
    if start == end and not finish:
        return []  # nothing to say (a replay of nothing opens nothing either)
    out = [("open", choice)] if first else []
    out.append(("tokens", choice, start, end))
    return out + ([("finish", choice)] if finish else [])


def _deltas(plan):
    """(choice, start, end, first, finish) of each delta, from each choice's token counts per delta."""
    done, out = {}, []
    for choice, n, finish in plan:
        start = done.get(choice, 0)
        out.append((choice, start, start + n, choice not in done, finish))
        done[choice] = start + n
    return out


def _run(deltas, resume=None):
    ids = EventIds(2, resume)
    return [(i, e) for d in deltas for i, e in ids.delta(d[0], d[2] - d[1], d[4], _events(d))]


def _resplit(deltas, point: ResumePoint):
    """The deltas a resumed router makes: each choice's tokens up to the client's count as one delta, then the
    rest as they come (here: as one more delta, the worst case for the skipping rule)."""
    ends = {}
    for d in deltas:
        ends[d[0]] = (d[2], d[4])
    out = []
    for choice in sorted(ends):
        end, finish = ends[choice]
        had = point.tokens[choice]
        out.append((choice, 0, had, True, False))
        if end > had or finish:
            out.append((choice, had, end, had == 0, finish))
    return out


def _covered(events):
    """What a client has from events: the tokens of each choice, and its opens and finishes (each once)."""
    tokens, marks = {0: [], 1: []}, []
    for e in events:
        if e[0] == "tokens":
            tokens[e[1]] += list(range(e[2], e[3]))
        else:
            marks.append(e)
    return tokens, sorted(marks)


@pytest.mark.parametrize("plan", [
    [(0, 1, False), (1, 2, False), (0, 3, False), (1, 1, True), (0, 2, True)],
    [(0, 4, True), (1, 4, True)],
    [(1, 1, False), (0, 1, False), (1, 5, False), (0, 2, True), (1, 0, True)],
])
def test_a_resume_from_any_event_gives_the_client_the_rest_once(plan):
    deltas = _deltas(plan)
    full = _run(deltas)
    want = _covered([e for _, e in full])
    for cut in range(1, len(full) + 1):
        have = [e for _, e in full[:cut]]
        point = ResumePoint.parse(full[cut - 1][0], 2)
        resumed = [e for _, e in _run(_resplit(deltas, point), point)]
        opened = {e[1] for e in have if e[0] == "open"}
        resumed = [e for e in resumed if not (e[0] == "open" and e[1] in opened)]  # (a replay opens quietly)
        assert _covered(have + resumed) == want, f"cut after event {cut}: {full[cut - 1][0]}"


def test_every_event_has_an_id_and_the_ids_say_what_the_client_has():
    deltas = _deltas([(0, 2, False), (1, 3, True), (0, 1, True)])
    ids = [i for i, _ in _run(deltas)]
    assert ids == ["0,0/0/0", "2,0", "2,0/1/0", "2,0/1/1", "2,3f", "2,3f/0/0", "3f,3f"]
    assert EventIds(1).usage() == "0/usage" and not EventIds(1, ResumePoint([3], [True], has_usage=True)).usage_due
    assert [i for i, _ in EventIds(2, enabled=False).delta(0, 2, True, ["a", "b"])] == [None, None]


@pytest.mark.parametrize("value, choices, why", [
    ("abc", 1, "not an event id"), ("1,2", 1, "has 2 choice(s)"), ("3f/0/1", 1, "not open"),
    ("1/5/0", 1, "not open"), ("9" * 20, 1, "not an event id"), ("1" + ",1" * 3000, 3001, "not an event id"),
])
def test_a_last_event_id_the_server_never_sent_is_a_400(value, choices, why):
    with pytest.raises(APIError) as err:
        ResumePoint.parse(value, choices)
    assert err.value.status == 400 and why in err.value.message and err.value.param == "Last-Event-ID"


def test_only_clients_that_accept_event_streams_get_ids():
    assert wants_event_ids("text/event-stream") and wants_event_ids("application/json, Text/Event-Stream")
    assert not wants_event_ids("*/*") and not wants_event_ids("application/json")


# -- the outputs so far, cut where the client stopped ------------------------------------------------------------

def _lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -0.5)


def _sampled(t: int) -> SampledToken:
    return SampledToken(0, t, -0.5)


def _request(request_id: str, prompt: list[int], generated=(), owner: str = "", logprobs=()) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(logprobs=1), generated_token_ids=list(generated),
                         generated_logprobs=list(logprobs), owner=owner)


def test_a_resumed_requests_outputs_are_cut_where_the_client_stopped():
    # a continuation's journal: its first two tokens came from another replica, without logprobs
    first = ReplicaOutput([5, 6, 7, 8, 9], [_lp(7), _lp(8), _lp(9)], "length", None, num_prompt_tokens=3)
    had, rest = _split(first, 3)
    assert had.token_ids == [5, 6, 7] and had.finish_reason is None and had.num_prompt_tokens == 3
    assert [e.token_id for e in had.logprobs] == [7]
    assert rest.token_ids == [8, 9] and [e.token_id for e in rest.logprobs] == [8, 9] and rest.finish_reason == "length"
    assert _split(first, 5)[1].token_ids == [] and _split(first, 5)[1].finish_reason == "length"
    running = ReplicaOutput([5, 6])
    assert len(_split(running, 2)) == 1  # nothing after the cut yet: the rest comes as it is made
    with pytest.raises(APIError) as err:
        _split(first, 6)
    assert err.value.status == 400 and "past the end" in err.value.message


# -- the scheduler's sessions ------------------------------------------------------------------------------------

class Released(list):
    """The replica side of sessions: what they abort (StepLoop.release in a real scheduler)."""

    def release(self, request_id: str) -> None:
        self.append(request_id)


def _take(connection: Connection) -> list:
    return asyncio.run(asyncio.wait_for(connection.take(), 1))


def test_a_session_journals_its_outputs_and_hands_them_to_the_router_that_attaches_it():
    released = Released()
    sessions = Sessions(released, grace_s=30)
    old, new = Connection(), Connection()
    # a continuation: token 9 came from another replica, with its logprobs, and the key-holder "k1" sent it
    earlier = TokenLogprob(9, -0.25, 1, [9, 4], [-0.25, -1.5])
    session = sessions.open(_request("r", [1, 2], [9], owner="k1", logprobs=[earlier]), old)
    session.put(RequestOutput("r", [10], [_sampled(10)], num_prompt_tokens=2, num_cached_tokens=1))
    session.put(RequestOutput("r", [11], [_sampled(11)]))
    assert sessions.detach(old) == {"r"} and released == []  # still running: kept
    with pytest.raises(StagemeshError, match="another prompt"):
        sessions.attach("r", [1, 3], "k1", new)
    for other in ("", "k2"):  # another owner: as if no such request were held
        with pytest.raises(NotHeld, match="no request 'r' is held here"):
            sessions.attach("r", [1, 2], other, new)
    sessions.attach("r", [1, 2], "k1", new)
    (update,) = _take(new)
    assert update.first and update.item.new_token_ids == [9, 10, 11] and update.item.num_prompt_tokens == 2
    # the moved token's logprobs replay with the rest: one per token, in order
    logprobs = update.item.new_logprobs
    assert [e.token_id for e in logprobs] == [9, 10, 11] and not update.item.finished
    assert (logprobs[0].logprob, logprobs[0].top_token_ids, logprobs[0].top_logprobs) == (-0.25, [9, 4], [-0.25, -1.5])
    session.put(RequestOutput("r", [12], finish_reason="length"))
    (update,) = _take(new)
    assert update.item.new_token_ids == [12] and update.item.finish_reason == "length"
    assert session.journal.new_token_ids == [9, 10, 11, 12]  # kept until the router releases it
    sessions.release("r", new)
    assert "r" not in sessions and released == []  # (it had finished: nothing to abort)
    with pytest.raises(NotHeld):
        sessions.attach("r", [1, 2], "k1", new)


def test_an_error_comes_after_the_tokens_and_a_second_attach_takes_the_request_over():
    sessions = Sessions(Released(), grace_s=30)
    first, second, third = Connection(), Connection(), Connection()
    session = sessions.open(_request("r", [1]), first)
    session.put(RequestOutput("r", [4]))
    session.put(RequestOutput("r", finish_reason="error", error="stage 1 failed"))
    sessions.attach("r", [1], "", second)
    items = [u.item for u in _take(second)]
    assert items[0].new_token_ids == [4] and items[1].finish_reason == "error"
    sessions.attach("r", [1], "", third)
    (update,) = _take(second)  # the stream that had it hears it went elsewhere
    assert isinstance(update.item.error, Taken)


def test_unresumed_sessions_end_after_the_grace_period_and_stops_free_the_kv_at_once():
    released = Released()
    sessions = Sessions(released, grace_s=5)
    connection = Connection()
    sessions.open(_request("running", [1]), connection)
    sessions.open(_request("done", [1]), connection).put(RequestOutput("done", [3], finish_reason="stop"))
    sessions.open(_request("stopped", [1]), connection)
    assert sessions.stop("stopped", connection) and released == ["stopped"]  # a stop string: KV freed now
    assert "stopped" in sessions  # its outputs kept until released
    sessions.detach(connection)
    sessions.sweep(float("inf"))
    assert len(sessions) == 0 and released == ["stopped", "running"]  # the finished ones need no abort
    with pytest.raises(StagemeshError, match="already in use"):
        sessions.open(_request("r", [1]), connection) and sessions.open(_request("r", [1]), connection)


def test_a_request_handed_on_comes_back_to_the_replica_that_handed_it_on_from_its_router_only():
    """A rebalance may move a request back where it ran before (A -> B -> A): the router that moved it still
    holds its finished "migrated" half on A, and its new half takes the id. Anyone else still finds it in use."""
    sessions = Sessions(Released(), grace_s=30)
    router, other = Connection(), Connection()
    sessions.open(_request("r", [1], owner="k1"), router).put(RequestOutput("r", [4], finish_reason="migrated"))
    sessions.open(_request("x", [1], owner="k1"), router).put(RequestOutput("x", [4], finish_reason="length"))
    for request, connection in ((_request("r", [1], owner="k2"), router), (_request("r", [1], owner="k1"), other),
                                (_request("x", [1], owner="k1"), router)):
        with pytest.raises(StagemeshError, match="already in use"):
            sessions.open(request, connection)
    back = sessions.open(_request("r", [1], [4], owner="k1"), router)
    back.put(RequestOutput("r", [5], finish_reason="length"))
    assert back.journal.new_token_ids == [4, 5]  # the continuation's journal: what it brought and what it made
    sessions.release("r", router)
    assert "r" not in sessions


def test_with_no_grace_period_a_broken_streams_sessions_end_at_once():
    released = Released()
    sessions = Sessions(released, grace_s=0)
    connection = Connection()
    sessions.open(_request("r", [1]), connection)
    sessions.detach(connection)
    assert len(sessions) == 0 and released == ["r"]


# -- the gateway's answers to resumes it cannot serve ------------------------------------------------------------

@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("resume-units") / "tok")
    with FakeRouter(model, "m") as r:
        yield r


def _post(router, body: dict, **headers) -> requests.Response:
    return requests.post(f"{router.base_url}/v1/completions", timeout=30, headers=headers,
                         json={"model": "m", "prompt": [5, 6], "max_tokens": 4, **body})


@pytest.mark.parametrize("body, headers, status, param", [
    ({"stream": True}, {"X-Request-Id": "gone", "Last-Event-ID": "2"}, 404, "request_id"),
    ({}, {"X-Request-Id": "x", "Last-Event-ID": "2"}, 400, "Last-Event-ID"),
    ({"stream": True}, {"Last-Event-ID": "2"}, 400, "request_id"),
    ({"stream": True, "n": 2}, {"X-Request-Id": "x", "Last-Event-ID": "2"}, 400, "Last-Event-ID"),
    ({"stream": True}, {"X-Request-Id": "x", "Last-Event-ID": "2;DROP"}, 400, "Last-Event-ID"),
])
def test_resumes_the_gateway_cannot_serve_get_clear_errors(router, body, headers, status, param):
    resp = _post(router, body, **headers)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


def test_events_carry_ids_only_for_clients_that_accept_event_streams(router):
    plain = _post(router, {"stream": True}).text
    assert "\nid:" not in "\n" + plain and plain.count("data: ") == 5  # 4 tokens (the last one finishes), [DONE]
    with_ids = _post(router, {"stream": True}, Accept="text/event-stream").text
    lines = with_ids.splitlines()
    ids = [line[4:] for line in lines if line.startswith("id: ")]
    assert len(ids) == with_ids.count("data: ") and ids[-2:] == ["4f", "4f/done"], ids


def test_the_event_id_grammar_rejects_nothing_it_produces():
    for tokens in itertools.product(range(3), repeat=2):
        for finished in itertools.product((False, True), repeat=2):
            ids = EventIds(2)
            ids.tokens, ids.finished = list(tokens), list(finished)
            for value in (ids._now(), ids.done(), ids.error(), ids.usage()):
                ResumePoint.parse(value, 2)


class _Builder:
    """A Responses stream's groups of events as router.responses_api.output.ResponseBuilder makes them: the
    opening, per delta the message's opening (with its first visible text) and a text delta, and the closing;
    numbered in order, the text each delta's token ids."""

    def __init__(self):
        self.sequence, self.opened, self.text = 0, False, []

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        return [self.event("response.created"), self.event("response.in_progress")]

    def deltas(self, tokens: list[int]) -> list[dict]:
        self.text += tokens
        visible = [t for t in tokens if t >= 0]  # (a negative token: text held back, as before a tool call)
        if not visible:
            return []
        opening = [] if self.opened else [self.event("output_item.added"), self.event("content_part.added")]
        self.opened = True
        return opening + [self.event("output_text.delta", delta=visible)]

    def closing(self) -> list[dict]:
        return [self.event("output_text.done", text=list(self.text)), self.event("content_part.done"),
                self.event("output_item.done"), self.event("response.completed")]


def _responses_stream(groups: list[list[int]], last_event_id: str | None = None) -> list[tuple[str, dict]]:
    """The events a stream of these deltas writes, or (resumed from last_event_id) the rest of them: the
    tokens the client has come back as one delta (what a replica's journal gives a router that attaches)."""
    from router.responses_api.stream_ids import Point, ResponseEventIds

    builder, point = _Builder(), Point.parse(last_event_id) if last_event_id else None
    ids = ResponseEventIds(True, point)
    if point is not None:  # the journal, cut where the client's copy ends
        tokens = [t for g in groups for t in g]
        groups = [tokens[:point.tokens], tokens[point.tokens:]]
    out = ids.opening(builder, builder.opening)
    for group in groups:
        out += ids.delta(builder, lambda: builder.deltas(group), len(group))  # noqa: B023 (called at once)
    return out + ids.closing(builder, builder.closing)


def _merged(events: list[dict]) -> list[tuple]:
    """The events as a client reads them, text deltas in a row joined (a resume sends what its replica made
    meanwhile as one delta), sequence numbers aside."""
    out: list[tuple] = []
    for e in events:
        if e["type"] == "output_text.delta" and out and out[-1][0] == "output_text.delta":
            out[-1] = ("output_text.delta", out[-1][1] + e["delta"])
        else:
            out.append((e["type"], e.get("delta") or e.get("text")))
    return out


def test_a_responses_stream_resumed_after_any_event_goes_on_with_the_events_the_client_lacks():
    """Whatever event the client read last, what it has and what the resumed stream writes make the undisturbed
    stream: nothing repeated, nothing missing, the same text, sequence numbers going on from its last one; the
    last event's id says the stream is complete, and a resume from it writes nothing."""
    for groups in ([[-1, 5], [6, 7], [-2], [8, 9, 10]], [[-1], [-2, -3]], [[4], [5]]):
        whole = _responses_stream(groups)
        events = [e for _, e in whole]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert whole[-1][0] == f"{sum(map(len, groups))}f/{len(events) - 1}"
        for k, (event_id, _) in enumerate(whole):
            rest = [e for _, e in _responses_stream(groups, event_id)]
            assert _merged(events[:k + 1] + rest) == _merged(events), (groups, event_id)
            assert [e["sequence_number"] for e in rest] == list(range(k + 1, k + 1 + len(rest))), (groups, event_id)


def test_a_responses_event_id_this_server_did_not_send_is_a_400():
    from router.responses_api.stream_ids import Point

    for value in ("3", "1f/2/0", "a/1", "1/2/3/4", "9" * 8 + "/1"):
        with pytest.raises(APIError) as err:
            Point.parse(value)
        assert err.value.status == 400 and err.value.param == "Last-Event-ID"
