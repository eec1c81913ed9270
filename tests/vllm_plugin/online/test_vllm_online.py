"""The online path: one real `vllm serve` subprocess on 127.0.0.1 with the plugin (support/vllm_server.py), driven
over HTTP as an RL trainer drives it (support/rl_client.py): vLLM's RL routes `/pause?mode=keep|wait|abort`,
`/start_draft_weight_update`, `/update_weights`, `/finish_weight_update`, `/resume`, `/start_weight_update` (a
policy sync) and `/weight_checker`. Issue 26 item 1 and 2, issue 24 items 9-10.

One server for the module (started once: 20-50 s on two shared cores), cold on draft B: its own first answers are
the references (greedy outputs are the target's, speculative decoding being lossless; the derived digests and
`/weight_checker` entries of a cold server on B). Every test leaves it as it found it: serving draft B, not paused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from lifecycle.vllm.observability.weight_checker import EQUAL, expected_checksums
from lifecycle.vllm.online.sessions import REFUSED
from support.rl_client import RLClient
from support.vllm_server import VllmServer, shm_names

#: as many requests as the server runs at once (max_num_seqs=4): each is running once it has streamed a token
LONG = [[1, 5, 7, 9, 11], [3, 3, 3, 3], [200, 17, 44, 90, 91, 92, 93], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
#: the tiny target's max_position_embeddings: a request can run for seconds (tiny's 128 cannot)
MAX_MODEL_LEN = 256
#: each request's budget (2-4 s here); greedy outputs of this length are the references
LONG_TOKENS = MAX_MODEL_LEN - 16
#: after the engine round trip, for the requests' adds to be in the scheduler (they were sent before it)
SETTLE_S = 0.3
#: RSS growth allowed per server process over 10 pushes: ~5x the largest growth measured (worker +368 KiB) and
#: below what keeping one copy of the draft's weights (~330 KiB) per push would add (3.3 MiB)
RSS_TOLERANCE_KIB = 2048


@pytest.fixture(scope="module")
def served(vllm_workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The server, a trainer's client, and the cold references (target outputs, cold-B digests and checksums).
    What was measured is written to `measured.json` in the server's folder."""
    server = VllmServer(vllm_workdir / "target", vllm_workdir / "draftB", tmp_path_factory.mktemp("serve"),
                        extra_args=["--max-model-len", str(MAX_MODEL_LEN)])
    server.start()
    shm_server = server.shm_entries()  # this server's own (the machine's /dev/shm is shared with other jobs)
    client = RLClient(server.url, server.model)
    measured: dict[str, Any] = {"start_s": round(server.start_seconds or 0, 1), "shm_of_the_server": len(shm_server)}
    try:
        ref = {"outputs": client.complete(), "long": [r["token_ids"] for r in InFlight(server, LONG).join()],
               "digests": client.rpc("lifecycle_derived_digests"), "checksums": client.checksums()}
        yield {"server": server, "client": client, "work": vllm_workdir, "ref": ref, "measured": measured}
    finally:
        client.close()
        stopped = server.stop()
        measured["stop_s"] = stopped.seconds
        measured["shm_of_the_server_left"] = len(shm_server & shm_names())
        (server.workdir / "measured.json").write_text(json.dumps(measured, indent=1))
    assert stopped.left == [] and not stopped.killed, stopped
    assert shm_server and not shm_server & shm_names()  # nothing of the server left in /dev/shm


@pytest.fixture
def client(served: dict[str, Any]) -> Iterator[RLClient]:
    """The trainer's client; after the test the server serves draft B again, unpaused, as a cold B server."""
    c: RLClient = served["client"]
    resets = c.resets
    yield c
    try:
        assert c.resets == resets, [str(e) for e in c.log[-8:]]  # the plugin's answers keep the connection
        assert not c.is_paused()
        _serving(served, "draftB")
    except BaseException:
        _restore(served)  # a failed test must not fail the next ones
        raise


def _restore(served: dict[str, Any]) -> None:
    """Back to draft B, unpaused, whatever a failed test left: requests in flight aborted, a session ended."""
    c: RLClient = served["client"]
    c.resume()
    state = _draft_state(c)
    if state["state"] == "PARTIALLY_LOADED":  # a push left open: a start would be refused (409) for 60 s
        c.take_over(f"epoch {state['epoch']}")
    steps = c.push(_info(served, "draftB"), weight_version="restored")
    assert _statuses(steps) == [200] * 5 and not c.is_paused(), [str(e) for e in steps]


def _info(served: dict[str, Any], draft: str, **extra: Any) -> dict[str, Any]:
    return {"path": str(served["work"] / draft), **extra}


def _draft_state(c: RLClient) -> dict[str, Any]:
    (rank0,) = c.rpc("lifecycle_states")
    return next(s for s in rank0 if s["role"] == "draft")


def _serving(served: dict[str, Any], draft: str) -> None:
    """The draft serves `draft`: outputs are the target's, the weight checker matches what the trainer sent, and
    (draft B) the derived buffers equal a cold server's, bit for bit."""
    c: RLClient = served["client"]
    assert _draft_state(c)["state"] == "DERIVED_REFRESHED"
    assert c.complete() == served["ref"]["outputs"]
    sent = expected_checksums(load_file(str(served["work"] / draft / "model.safetensors")))
    target = {k: v for k, v in served["ref"]["checksums"].items() if ":draft." not in k}
    assert c.weight_checker("compare", {**target, **sent}).answer == {"match": True, "mismatches": []}
    if draft == "draftB":
        assert c.rpc("lifecycle_derived_digests") == served["ref"]["digests"]


def _statuses(steps: list[Any]) -> list[int]:
    return [s.status for s in steps]


class InFlight:
    """Streamed requests sent from threads (one client each), as several rollout workers would.

    What the client reads is no proof of where the engine stands: on a loaded machine a stream was measured to
    deliver a whole 240-token request at once, 2 s after it began. So `queued(c)` makes it certain instead: it
    sends the requests while the engine is paused with `keep` (vLLM queues them in the scheduler, nothing runs),
    waits until each stream has its answer's headers, then an engine round trip (`/collective_rpc` goes to the
    engine core behind the requests' adds) and `SETTLE_S`; `resume` then starts every request in the same step."""

    def __init__(self, server: VllmServer, prompts: list[list[int]], max_tokens: int = LONG_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.received = [0] * len(prompts)
        self.opened = [threading.Event() for _ in prompts]
        self.finished_at: list[float | None] = [None] * len(prompts)
        self.results: list[dict[str, Any] | None] = [None] * len(prompts)
        self.errors: list[BaseException] = []
        # the clients are made here: making one in its thread, beside streaming threads, took seconds
        clients = [RLClient(server.url, server.model) for _ in prompts]
        self.threads = [threading.Thread(target=self._one, args=(clients[i], i, p), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _one(self, c: RLClient, i: int, prompt: list[int]) -> None:
        def got(n: int) -> None:
            self.received[i] = n

        try:
            self.results[i] = c.stream(prompt, self.max_tokens, got, opened=self.opened[i].set)
            self.finished_at[i] = time.monotonic()
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.opened[i].set()  # a failed request must not keep queued() waiting
            c.close()

    @classmethod
    def queued(cls, c: RLClient, server: VllmServer, prompts: list[list[int]] = LONG) -> InFlight:
        """The requests, every one queued in the engine, which `c` leaves paused (`keep`): resume it next."""
        assert c.pause("keep").ok
        flight = cls(server, prompts)
        for event in flight.opened:
            assert event.wait(60), "a stream did not open within 60 s"
        assert not flight.errors, flight.errors
        c.rpc("lifecycle_states")
        time.sleep(SETTLE_S)
        assert flight.finished() == 0 and flight.received == [0] * len(prompts)  # nothing ran
        return flight

    def settled(self, quiet_s: float = 0.3, timeout: float = 30) -> tuple[list[int], list[bool]]:
        """Under a keep pause: wait until the streams have caught up with the frozen engine (nothing arrives for
        `quiet_s`). Tokens received and finished, per request."""
        deadline = time.monotonic() + timeout
        seen = None
        while True:
            now = (list(self.received), [at is not None for at in self.finished_at])
            if now == seen or time.monotonic() > deadline:
                return now
            seen = now
            time.sleep(quiet_s)

    def moved_past(self, received: list[int], which: list[bool], timeout: float = 60) -> None:
        """Wait until every request marked in `which` has streamed past `received` (or finished): it runs in the
        engine again. A keep pause resets the prefix cache, which sends every running request back to the queue
        (vLLM's `reset_prefix_cache(reset_running_requests=True)`); after the resume the scheduler takes them back
        as its token budget allows (128 a step here), and a `wait` pause drains only the ones it has taken back:
        the rest stay queued until the next resume (measured: 2 of 4 queued for 60 s)."""
        deadline = time.monotonic() + timeout
        while not all(self.received[i] > n or self.finished_at[i] is not None
                      for i, (n, w) in enumerate(zip(received, which, strict=True)) if w):
            assert time.monotonic() < deadline and not self.errors, (received, self.received, self.errors)
            time.sleep(0.005)

    def finished(self) -> int:
        return sum(at is not None for at in self.finished_at)

    def all_finish(self, which: list[bool], timeout: float = 60) -> bool:
        """Whether every request marked in `which` ends its stream within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not all(at is not None for at, w in zip(self.finished_at, which, strict=True) if w):
            if time.monotonic() > deadline or self.errors:
                return False
            time.sleep(0.01)
        return True

    def join(self, timeout: float = 120) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not self.errors, self.errors
        assert all(r is not None and r["done"] for r in self.results), "a stream did not end with [DONE]"
        return [r for r in self.results if r is not None]


def _frozen_in_flight(c: RLClient, server: VllmServer, attempts: int = 5) -> tuple[InFlight, list[int], list[bool]]:
    """Requests running in the engine, frozen there by a keep pause (`c` leaves it paused), at least one of them
    with tokens streamed and unfinished: its tokens and whether it finished, per request. The engine can run
    ahead of the API server by seconds on a loaded machine (a resume then a pause let 240-token requests finish),
    so when no request was caught unfinished, the round is run again."""
    for _ in range(attempts):
        flight = InFlight.queued(c, server)
        assert c.resume().ok and c.pause("keep").ok
        received, finished = flight.settled()
        if any(n and not done for n, done in zip(received, finished, strict=True)):
            return flight, received, finished
        assert c.resume().ok
        flight.join()
    raise AssertionError(f"no request was still running when a keep pause landed, {attempts} tries")


# ---- pushes --------------------------------------------------------------------------------------------------


def test_an_idle_push_serves_the_new_draft_and_the_weight_checker_shows_it(served: dict[str, Any],
                                                                          client: RLClient) -> None:
    began = time.perf_counter()
    assert _statuses(client.push(_info(served, "draftA"), weight_version="A-1")) == [200] * 5
    served["measured"]["idle_push_ms"] = round((time.perf_counter() - began) * 1000)
    assert client.weight_version() == "A-1"
    _serving(served, "draftA")
    # the draft's entries are in vLLM's own checksum answer; comparing with B's lists exactly the draft's weights
    checks = client.checksums()
    draft_keys = sorted(k for k in checks if ":draft.model." in k)
    assert len(draft_keys) == 19 and {v for k, v in checks.items() if ":draft.derived." in k} == {EQUAL}
    assert client.weight_checker("compare", served["ref"]["checksums"]).answer["mismatches"] == draft_keys
    assert _statuses(client.push(_info(served, "draftB"), weight_version="B-1")) == [200] * 5


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_a_push_under_pause_with_requests_in_flight(mode: str, served: dict[str, Any], client: RLClient) -> None:
    ref = served["ref"]["long"]
    flight, received, finished = _frozen_in_flight(client, served["server"])
    in_flight = [n > 0 and not done for n, done in zip(received, finished, strict=True)]
    served["measured"][f"{mode}_tokens_finished_at_pause"] = [received, finished]
    if mode == "wait":  # running on, drained by the pause (`wait` right after `keep` answered at once: measured),
        # once every request frozen in flight runs again (see `moved_past`)
        assert client.resume().ok
        flight.moved_past(received, in_flight)
        assert client.pause("wait").ok
    elif mode == "abort":  # aborted from the keep pause: where they stand
        assert client.pause("abort").ok
    steps = client.push(_info(served, "draftA"), weight_version=f"{mode}-A", pause=None)
    assert _statuses(steps) == [200] * 3
    before_resume = flight.settled() if mode != "wait" else (list(flight.received), [])
    if mode == "wait":  # drained by the pause: each running request ends while the engine is still paused (one the
        # pause held would end only after the resume); timed on the engine's side, not by when a busy client read it
        assert flight.all_finish(in_flight), (received, flight.finished_at)
    resumed_at = time.monotonic()
    assert client.resume().ok
    results = flight.join()
    tokens = [r["token_ids"] for r in results]
    reasons = [r["finish_reason"] for r in results]
    if mode == "keep":  # frozen across the push, then finished with the target's greedy output
        assert before_resume == (received, finished), ((received, finished), before_resume)
        assert tokens == ref and reasons == ["length"] * len(LONG)
    elif mode == "wait":  # the pause answered once the running requests had finished; the push ran after them
        assert tokens == ref and reasons == ["length"] * len(LONG)
    else:  # each request running aborted where it stood (vLLM's FinishReason.ABORT): what it had is the target's
        assert [why for why, now in zip(reasons, in_flight, strict=True) if now] == ["abort"] * sum(in_flight), reasons
        assert [len(t) for t, now in zip(tokens, in_flight, strict=True) if now] == [
            n for n, now in zip(received, in_flight, strict=True) if now]
        assert all(why in ("abort", "length", None) and t == full[:len(t)]
                   for t, why, full in zip(tokens, reasons, ref, strict=True))
        assert all(at is not None and at < resumed_at for at in flight.finished_at)  # every one ended by the abort
    # the new draft, after the push
    assert [r["token_ids"] for r in InFlight(served["server"], LONG).join()] == ref
    assert _statuses(client.push(_info(served, "draftB"))) == [200] * 5


def test_an_unpaused_push_with_requests_in_flight(served: dict[str, Any], client: RLClient) -> None:
    flight, _, _ = _frozen_in_flight(client, served["server"])
    assert client.resume().ok  # at least one request runs on
    assert _statuses(client.push(_info(served, "draftA"), weight_version="unpaused", pause=None)) == [200] * 3
    results = flight.join()
    assert [r["token_ids"] for r in results] == served["ref"]["long"]
    assert [r["finish_reason"] for r in results] == ["length"] * len(LONG)
    assert _statuses(client.push(_info(served, "draftB"), pause=None)) == [200] * 3


# ---- refused and abandoned pushes (issue 24 items 9 and 10) ----------------------------------------------------


def test_a_refused_finish_answers_422_naming_it_then_a_corrected_push_and_a_policy_sync_proceed(
        served: dict[str, Any], client: RLClient) -> None:
    steps = client.push(_info(served, "draftA", exclude_prefixes=["layers.1."]), weight_version="A-bad")
    assert _statuses(steps) == [200, 200, 200, 422, 200]
    message = steps[3].message
    assert message.startswith(f"{REFUSED} the draft weight update: LayersNotReadyError:")
    assert "layers.1: layers.1.self_attn.qkv_proj.weight" in message and "Call to collective_rpc" not in message
    state = _draft_state(client)
    assert state["state"] == "QUARANTINED" and "layers.1" in state["quarantine_reason"]
    assert client.complete() == served["ref"]["outputs"]  # served without speculation
    assert {v for k, v in client.checksums().items() if ":draft.derived." in k} == {"not-serving:QUARANTINED"}
    # before: every later start answered 500 "start_weight_update called while a weight update is already active"
    assert _statuses(client.push(_info(served, "draftB"), weight_version="B-2")) == [200] * 5
    _serving(served, "draftB")
    epoch = _draft_state(client)["epoch"]
    policy = client.push({"path": str(served["work"] / "target")}, weight_version="policy-1", draft=False)
    assert _statuses(policy) == [200] * 5 and client.weight_version() == "policy-1"
    assert _draft_state(client)["epoch"] == epoch  # the target's sync leaves the draft as it was


def test_an_abandoned_push_refuses_a_start_until_taken_over_by_name_then_the_next_push_proceeds(
        served: dict[str, Any], client: RLClient) -> None:
    # the trainer dies between /update_weights and /finish_weight_update
    assert _statuses([client.pause(), client.start_draft(), client.update(_info(served, "draftA")),
                      client.resume()]) == [200] * 4
    abandoned = _draft_state(client)
    assert abandoned["state"] == "PARTIALLY_LOADED"
    assert client.complete() == served["ref"]["outputs"]
    # a start within RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S (default 60 s) of its last call is refused, naming it
    refused = client.push(_info(served, "draftB"), weight_version="B-3")
    assert _statuses(refused) == [200, 409, 200] and f"epoch {abandoned['epoch']}" in refused[1].message
    assert client.take_over(f"epoch {abandoned['epoch']}").ok  # the operator (or the trainer, restarted) ends it
    assert _statuses(client.push(_info(served, "draftB"), weight_version="B-3")) == [200] * 5
    (ended,) = [e for e in served["server"].audit_events() if e["event"] == "weight_update_session_ended"
                and e["epoch"] == abandoned["epoch"]]
    assert ended["outcome"] == "taken_over" and ended["level"] == "warning" and ended["chunks"] == 1
    assert ended["reason"].startswith("taken over: lifecycle_take_over_push ended the open draft session")
    assert ended["push"] == f"epoch {abandoned['epoch']}"


def test_an_abandoned_draft_push_then_a_policy_sync(served: dict[str, Any], client: RLClient) -> None:
    assert _statuses([client.start_draft(), client.update(_info(served, "draftA"))]) == [200] * 2
    epoch = _draft_state(client)["epoch"]
    policy = client.push({"path": str(served["work"] / "target")}, weight_version="policy-2", draft=False)
    assert _statuses(policy) == [200, 409, 200]  # the draft push is still active
    assert client.take_over(f"epoch {epoch}").ok
    policy = client.push({"path": str(served["work"] / "target")}, weight_version="policy-2", draft=False)
    assert _statuses(policy) == [200] * 5
    state = _draft_state(client)
    assert state["state"] == "QUARANTINED" and state["quarantine_reason"].startswith("taken over:")
    assert _statuses(client.push(_info(served, "draftB"))) == [200] * 5  # the next draft push recovers it


def test_a_refused_chunk_answers_422_and_the_next_push_proceeds(served: dict[str, Any], client: RLClient) -> None:
    steps = client.push(_info(served, "no-such-draft"))
    assert _statuses(steps) == [200, 200, 422, 200]
    assert steps[2].message.startswith(f"{REFUSED} the draft's update_weights chunk: CheckpointError:")
    assert "Nothing was written" in steps[2].message and _draft_state(client)["state"] == "DERIVED_REFRESHED"
    assert _statuses(client.push(_info(served, "draftB"))) == [200] * 5


def test_ten_successive_pushes_keep_every_process_and_dev_shm_flat(served: dict[str, Any], client: RLClient) -> None:
    server: VllmServer = served["server"]
    assert _statuses(client.push(_info(served, "draftA"))) == [200] * 5  # warm: the first push's allocations
    assert _statuses(client.push(_info(served, "draftB"))) == [200] * 5
    rss, shm = server.rss(), server.shm_entries()
    times = []
    for i in range(10):
        began = time.perf_counter()
        assert _statuses(client.push(_info(served, "draftA" if i % 2 == 0 else "draftB"), f"loop-{i}")) == [200] * 5
        times.append(round((time.perf_counter() - began) * 1000))
    after, shm_after = server.rss(), server.shm_entries()
    grown = {f"{name}/{pid}": after[pid][1] - kib for pid, (name, kib) in rss.items()}
    served["measured"].update(push_ms=times, rss_kib={f"{n}/{p}": k for p, (n, k) in rss.items()},
                              rss_growth_kib=grown, shm_of_the_server_before_after=[len(shm), len(shm_after)])
    assert set(after) == set(rss) and len(rss) >= 3  # API server, engine core, worker (and the resource tracker)
    assert all(g <= RSS_TOLERANCE_KIB for g in grown.values()), grown
    assert shm and len(shm_after) == len(shm), (sorted(shm), sorted(shm_after))


def test_vllms_own_misuse_answers_stay_vllms(served: dict[str, Any], client: RLClient) -> None:
    # a chunk or a finish without a session is vLLM's refusal (its generic 500); the plugin adds nothing to it
    other = RLClient(served["server"].url, served["server"].model)
    try:
        update = other.update(_info(served, "draftB"))
        assert update.status == 500 and "start_weight_update must be called before update_weights" in update.message
        finish = other.finish()
        assert finish.status == 500 and "without a matching start_weight_update" in finish.message
    finally:
        other.close()
    assert _draft_state(client)["state"] == "DERIVED_REFRESHED"


def test_each_push_audits_the_trainers_weight_version_in_its_epoch(served: dict[str, Any], client: RLClient) -> None:
    assert _statuses(client.push(_info(served, "draftA"), weight_version="A-audit")) == [200] * 5
    assert _statuses(client.push(_info(served, "draftB"), weight_version="B-audit")) == [200] * 5
    events = served["server"].audit_events()
    noted = {e["weight_version"]: e["epoch"] for e in events if e["event"] == "weight_version"}
    ended = {e["weight_version"]: (e["epoch"], e["outcome"]) for e in events
             if e["event"] == "weight_update_session_ended"}
    assert noted["B-audit"] == noted["A-audit"] + 1 == _draft_state(client)["epoch"]
    assert ended["A-audit"] == (noted["A-audit"], "finished") and ended["B-audit"] == (noted["B-audit"], "finished")
    # the target's syncs are in no draft epoch (the canary's `acceptance` periods carry vLLM's current version, a
    # policy's too: that is what they were served under)
    assert not any((e.get("weight_version") or "").startswith("policy") for e in events
                   if e["event"] in ("weight_version", "weight_update_session_ended"))
