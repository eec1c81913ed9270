"""One push owns the draft from its start to its finish (issue 32 items 1-3 and 10): two trainers that do not know
about each other, one that retries, one that sends other bytes, on a real `vllm serve` driven over HTTP
(support/vllm_server.py, support/rl_client.py), with the plugin's defaults (no setting in the server's environment).

One server for the module, cold on draft B (module fixture `served`). Trainer T1 pushes draft A, T2 draft B (or the
other way round), each push being `start`, a chunk with layer 0, a chunk with the rest, `finish`. Whatever the
interleaving, after every step: a draft that is usable equals, digest for digest (`/weight_checker compare` against
`expected_checksums` of what a trainer sent), the draft of the last push whose finish answered 200, and
`/weight_info` is that push's version; a finish that answered 200 serves its own trainer's draft. On the old code
(d032fd9) T2's start took T1's push over, T1's next chunk landed in T2's push, and T1's finish served a mix with a
clean audit; a chunk sent again answered 422 "Attempted to load weight ... into parameter ([0])" and quarantined.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from lifecycle.vllm.observability.weight_checker import expected_checksums
from lifecycle.vllm.online.pushes import CONFLICT, LABEL_CAP
from lifecycle.vllm.online.sessions import REFUSED, TAKE_OVER_RPC
from lifecycle.vllm.settings import TAKEOVER_IDLE_ENV
from support.rl_client import Exchange, RLClient
from support.vllm_server import VllmServer

#: the tiny DFlash draft's tensors outside layer 0 (support: lifecycle.vllm.demo.tiny)
NOT_LAYER0 = ["layers.1.", "fc.", "hidden_norm.", "norm."]
DEFAULT_IDLE_S = 60


@pytest.fixture(scope="module")
def served(vllm_workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    server = VllmServer(vllm_workdir / "target", vllm_workdir / "draftB", tmp_path_factory.mktemp("serve_pushes"))
    server.start()
    clients = [RLClient(server.url, server.model) for _ in range(3)]
    target = {k: v for k, v in clients[0].checksums().items() if ":draft." not in k}
    expected = {d: {**target, **expected_checksums(load_file(str(vllm_workdir / d / "model.safetensors")))}
                for d in ("draftA", "draftB")}
    state = {"server": server, "clients": clients, "work": vllm_workdir, "expected": expected,
             "serving": ("draftB", None)}  # (draft, weight_version) the last push that committed left
    try:
        yield state
    finally:
        for c in clients:
            c.close()
        stopped = server.stop()
    assert stopped.left == [], stopped


@pytest.fixture
def trainers(served: dict[str, Any]) -> Iterator[tuple[RLClient, RLClient]]:
    """T1 and T2 (an operator's client cleans up after the test: any push left open is taken over)."""
    t1, t2, _ = served["clients"]
    yield t1, t2
    _clean(served)


def _clean(served: dict[str, Any]) -> None:
    op: RLClient = served["clients"][2]
    state = _draft_state(op)
    if state["state"] == "PARTIALLY_LOADED":
        op.take_over(f"epoch {state['epoch']}")
    op.resume()


def _info(served: dict[str, Any], draft: str, part: str = "all", **extra: Any) -> dict[str, Any]:
    exclude = {"all": [], "layer0": NOT_LAYER0, "rest": ["layers.0."]}[part]
    return {"path": str(served["work"] / draft), **({"exclude_prefixes": exclude} if exclude else {}), **extra}


def _draft_state(c: RLClient) -> dict[str, Any]:
    (rank0,) = c.rpc("lifecycle_states")
    return dict(next(s for s in rank0 if s["role"] == "draft"))


def _serves(served: dict[str, Any], c: RLClient, draft: str) -> bool:
    """The engine serves exactly `draft` (every draft weight's digest, every derived buffer equal to a cold build)."""
    answer = c.weight_checker("compare", served["expected"][draft]).answer
    return answer == {"match": True, "mismatches": []}


def _committed(served: dict[str, Any], draft: str, version: str | None) -> None:
    served["serving"] = (draft, version)


def _never_mixed(served: dict[str, Any], c: RLClient, where: str) -> str:
    """A usable draft is exactly the last committed push's, and /weight_info names that push; else the draft does
    not serve (the target's tokens, without speculation). Returns the state."""
    state = _draft_state(c)
    draft, version = served["serving"]
    if state["state"] in ("DERIVED_REFRESHED", "GRAPH_CAPTURED"):
        assert _serves(served, c, draft), f"{where}: usable, but not exactly {draft} (the last committed push)"
        if version is not None:
            assert c.weight_version() == version, where
    else:
        assert state["state"] in ("QUARANTINED", "PARTIALLY_LOADED"), (where, state)
    return str(state["state"])


def _statuses(steps: list[Exchange]) -> list[int]:
    return [s.status for s in steps]


def _step(served: dict[str, Any], c: RLClient, draft: str, step: int, version: str, **extra: Any) -> Exchange:
    """Step `step` of a push of `draft`: 0 start, 1 the layer-0 chunk, 2 the rest, 3 finish."""
    if step == 0:
        return c.start_draft()
    if step < 3:
        return c.update(_info(served, draft, "layer0" if step == 1 else "rest", **extra))
    return c.finish(version)


def _push(served: dict[str, Any], c: RLClient, draft: str, version: str, **extra: Any) -> list[Exchange]:
    """start, the layer-0 chunk, the rest, finish (stops at the first answer that is not 200)."""
    steps: list[Exchange] = []
    for step in range(4):
        steps.append(_step(served, c, draft, step, version, **extra))
        if not steps[-1].ok:
            break
    if steps[-1].ok and len(steps) == 4:
        _committed(served, draft, version)
    return steps


# ---- one push at a time, by default -------------------------------------------------------------------------------


def test_a_start_while_a_push_is_active_is_refused_by_default_naming_its_age_and_how_to_take_it_over(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    t1, t2 = trainers
    assert t1.start_draft().ok and t1.update(_info(served, "draftA", "layer0")).ok
    epoch = _draft_state(t1)["epoch"]
    for refused in (t2.start_draft(), t2.start_policy()):
        assert refused.status == 409, refused
        m = refused.message
        assert m.startswith(f"{REFUSED} start_") and f"epoch {epoch}, opened " in m and "1 update_weights chunk(s)" in m
        assert f"{TAKEOVER_IDLE_ENV}={DEFAULT_IDLE_S} takes an open session over only after" in m
        assert TAKE_OVER_RPC in m and f'"push": "epoch {epoch}"' in m and "Nothing was changed" in m
    # the open push is untouched: its own calls complete it, and it serves A exactly
    assert t1.update(_info(served, "draftA", "rest")).ok and t1.finish("A-own").ok
    _committed(served, "draftA", "A-own")
    assert _never_mixed(served, t1, "after T1's finish") == "DERIVED_REFRESHED"
    assert _statuses(_push(served, t2, "draftB", "B-after")) == [200] * 4  # T2's turn, after T1's finish


def test_the_issues_interleaving_never_serves_a_mixed_draft(served: dict[str, Any],
                                                            trainers: tuple[RLClient, RLClient]) -> None:
    """Issue 32 item 1, as filed: T1 starts and sends B's layer 0; T2 starts and sends A's layer 0; T1 sends B's
    layer 1 and the rest; T2 sends A's rest; T1 finishes "r2-t1". Before: every call 200, a mixed draft served as
    GRAPH_CAPTURED with a clean audit and /weight_info "r2-t1"."""
    t1, t2 = trainers
    _push(served, t1, "draftA", "r1")  # serving A: the mix the issue describes would be visible
    steps = [t1.start_draft(), t1.update(_info(served, "draftB", "layer0")), t2.start_draft(),
             t2.update(_info(served, "draftA", "layer0")), t1.update(_info(served, "draftB", "rest")),
             t2.update(_info(served, "draftA", "rest")), t1.finish("r2-t1")]
    assert _statuses(steps)[:3] == [200, 200, 409], [str(s) for s in steps]
    # T2 went on after its 409: its layer 0 (other bytes than T1's) refuses the push, which ends; the rest finds
    # no push open (vLLM's own 500)
    assert steps[3].status == 422 and "with other bytes than this push already wrote" in steps[3].message
    assert "layers.0." in steps[3].message
    assert [s.status for s in steps[4:]] == [500, 500, 500], [str(s) for s in steps]
    assert _never_mixed(served, t1, "after the interleaving") == "QUARANTINED"
    assert t1.weight_version() != "r2-t1"


@pytest.mark.parametrize("ignores_errors", [False, True], ids=["stops-at-an-error", "ignores-errors"])
def test_every_interleaving_of_two_trainers_full_pushes_never_serves_a_mixed_draft(
        ignores_errors: bool, served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    """Every order of two pushes' calls (T1 first: the other half is the same with the names swapped), the
    trainers sending no push id: each finish that answers 200 serves its own trainer's draft, and after every
    interleaving the draft is the last committed push's or does not serve. A trainer that gets an error stops its
    push (a careful trainer), or goes on regardless (`ignores-errors`: it learns nothing from the answers)."""
    t1, t2 = trainers
    committed = 0
    orders = sorted({o for o in itertools.permutations([1, 1, 1, 1, 2, 2, 2, 2]) if o[0] == 1})
    for n, order in enumerate(orders):
        drafts = {1: "draftA", 2: "draftB"} if n % 2 else {1: "draftB", 2: "draftA"}
        clients = {1: t1, 2: t2}
        done = {1: 0, 2: 0}
        stopped: set[int] = set()
        trace = []
        for who in order:
            step = done[who]
            done[who] += 1
            if who in stopped:
                continue
            answer = _step(served, clients[who], drafts[who], step, f"o{n}-t{who}")
            trace.append((who, step, answer.status))
            if answer.ok and step == 3:  # a finish that answered 200: its own trainer's draft, exactly
                _committed(served, drafts[who], f"o{n}-t{who}")
                committed += 1
                _never_mixed(served, t1, f"order {order}, after T{who}'s finish: {trace}")
            elif not answer.ok and not ignores_errors:
                stopped.add(who)
        _never_mixed(served, t1, f"order {order}: {trace}")
        _clean(served)
    assert committed >= 5, committed  # pushes committed and checked (many orders refuse both: fail closed)


# ---- two threads at once ------------------------------------------------------------------------------------------


def test_two_threads_pushing_at_once_never_serve_a_mixed_draft(served: dict[str, Any],
                                                               trainers: tuple[RLClient, RLClient]) -> None:
    rounds, lock = 8, threading.Lock()
    for r in range(rounds):
        finished: list[tuple[float, str, str]] = []
        barrier = threading.Barrier(2)

        def trainer(c: RLClient, draft: str, version: str, barrier: threading.Barrier,
                    finished: list[tuple[float, str, str]]) -> None:
            barrier.wait()
            steps = _push(served, c, draft, version)
            if len(steps) == 4 and steps[-1].ok:
                with lock:
                    finished.append((time.monotonic(), draft, version))

        threads = [threading.Thread(target=trainer, args=(c, d, f"r{r}-{d}", barrier, finished))
                   for c, d in zip(trainers, ("draftA", "draftB"), strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if finished:  # the later commit is what serves (two commits cannot overlap: one push at a time)
            _, draft, version = max(finished)
            _committed(served, draft, version)
        _never_mixed(served, trainers[0], f"round {r}: {finished}")
        _clean(served)


# ---- push ids, a finish of another push, an explicit take-over ---------------------------------------------------


def test_with_push_ids_another_trainers_chunk_or_finish_is_refused_409_and_the_open_push_goes_on(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    t1, t2 = trainers
    assert t1.start_draft().ok and t1.update(_info(served, "draftA", "layer0", push_id="t1-7")).ok
    foreign = t2.update(_info(served, "draftB", "rest", push_id="t2-3"))
    unnamed = t2.update(_info(served, "draftB", "rest"))
    stray_finish = t2.finish("t2-3")  # the trainer that did not start finishes
    no_version = t2.finish()
    for refused in (foreign, unnamed, stray_finish, no_version):
        assert refused.status == 409 and refused.message.startswith(CONFLICT), refused
        assert "push_id t1-7" in refused.message and "the open push goes on" in refused.message
    assert _draft_state(t1)["state"] == "PARTIALLY_LOADED"  # nothing of them was written
    assert t1.update(_info(served, "draftA", "rest", push_id="t1-7")).ok
    assert t1.update(_info(served, "draftA", "rest", push_id="t1-7")).ok  # a retry, too
    assert t1.finish("t1-7").ok
    _committed(served, "draftA", "t1-7")
    assert _never_mixed(served, t1, "after T1's finish") == "DERIVED_REFRESHED"
    ended = [e for e in served["server"].audit_events() if e["event"] == "weight_update_session_ended"][-1]
    assert ended["push_id"] == "t1-7" and ended["outcome"] == "finished" and ended["resent_tensors"] == 14
    # without push ids the plugin cannot tell whose finish it is: a stray finish commits the open push, whose bytes
    # are all one trainer's (never a mix); /weight_info then carries the stray finish's version
    assert t1.start_draft().ok and t1.update(_info(served, "draftB")).ok
    assert t2.finish("t2-stray").ok
    _committed(served, "draftB", "t2-stray")
    assert _never_mixed(served, t1, "after the stray finish") == "DERIVED_REFRESHED"
    late = t1.finish("t1-own")
    assert late.status == 500 and "without a matching start_weight_update" in late.message  # vLLM's own


def test_an_explicit_take_over_ends_the_old_push_so_none_of_its_later_calls_land(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    t1, t2 = trainers
    _push(served, t1, "draftB", "before")
    assert t1.start_draft().ok and t1.update(_info(served, "draftA", "layer0")).ok
    epoch = _draft_state(t1)["epoch"]
    wrong = t2.take_over(f"epoch {epoch - 1}")
    assert wrong.status != 200 and f"the open push is epoch {epoch}" in wrong.message
    assert t2.take_over(f"epoch {epoch}").ok
    assert _draft_state(t2)["state"] == "QUARANTINED"  # its layer 0 was written: never served
    late = t1.update(_info(served, "draftA", "rest"))  # T1 does not know: no push is open
    assert late.status == 500 and "start_weight_update must be called before update_weights" in late.message
    # T2's push, with an id: T1's late calls cannot land in it
    assert t2.start_draft().ok and t2.update(_info(served, "draftB", "layer0", push_id="t2")).ok
    assert t1.update(_info(served, "draftA", "rest")).status == 409
    assert t1.finish("t1").status == 409
    assert t2.update(_info(served, "draftB", "rest", push_id="t2")).ok and t2.finish("t2").ok
    _committed(served, "draftB", "t2")
    assert _never_mixed(served, t1, "after T2's finish") == "DERIVED_REFRESHED"
    ended = [e for e in served["server"].audit_events() if e["event"] == "weight_update_session_ended"][-2:]
    assert [e["outcome"] for e in ended] == ["taken_over", "finished"] and ended[0]["push"] == f"epoch {epoch}"
    assert ended[1]["took_over"] == f"epoch {epoch}" and ended[1]["push"] == f"epoch {epoch + 1}"
    # without push ids, a late chunk of the taken-over push that lands in the next one is caught by its bytes
    assert t1.start_draft().ok and t1.update(_info(served, "draftA", "layer0")).ok
    assert t2.take_over(f"epoch {epoch + 2}").ok and t2.start_draft().ok
    assert t2.update(_info(served, "draftB")).ok
    stale = t1.update(_info(served, "draftA", "rest"))
    assert stale.status == 422 and "with other bytes than this push already wrote" in stale.message
    assert _never_mixed(served, t1, "after the late chunk") == "QUARANTINED"
    assert t2.finish("t2-b").status == 500  # its push was refused: never committed with T1's bytes


# ---- a chunk sent again --------------------------------------------------------------------------------------------


def test_a_chunk_sent_again_with_the_same_bytes_is_a_no_op_and_the_push_commits(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient], tmp_path: Path) -> None:
    t1, _ = trainers
    copy = tmp_path / "draftA-copy"
    shutil.copytree(served["work"] / "draftA", copy)
    steps = [t1.start_draft(), t1.update(_info(served, "draftA")), t1.update(_info(served, "draftA")),
             t1.update(_info(served, "draftA", "layer0")), t1.update({"path": str(copy)}), t1.finish("A-retried")]
    assert _statuses(steps) == [200] * 6, [str(s) for s in steps]  # before: 422 AssertionError, quarantined
    _committed(served, "draftA", "A-retried")
    assert _never_mixed(served, t1, "after the retried push") == "DERIVED_REFRESHED"
    ended = [e for e in served["server"].audit_events() if e["event"] == "weight_update_session_ended"][-1]
    assert ended["outcome"] == "finished" and ended["chunks"] == 4 and ended["resent_tensors"] == 25 + 11 + 25


def test_a_chunk_with_other_bytes_for_a_tensor_the_push_wrote_refuses_the_push(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    t1, _ = trainers
    _push(served, t1, "draftB", "B-base")
    names = list(load_file(str(served["work"] / "draftA" / "model.safetensors")))
    only_q = [n for n in names if n != "layers.0.self_attn.q_proj.weight"]
    # its layer is not complete yet: nothing was written, the rollback is exact and the draft serves B again
    steps = [t1.start_draft(), t1.update(_info(served, "draftA", exclude_prefixes=only_q)),
             t1.update(_info(served, "draftB", exclude_prefixes=only_q))]
    assert _statuses(steps) == [200, 200, 422], [str(s) for s in steps]
    m = steps[2].message
    assert m.startswith(f"{REFUSED} the draft's update_weights chunk: ChunkConflictError:")
    assert "layers.0.self_attn.q_proj.weight" in m and "Nothing was written" in m
    assert _never_mixed(served, t1, "after the refused push") == "DERIVED_REFRESHED"
    # once layers were written, the refused push leaves the draft quarantined (it keeps no copy of the last weights)
    steps = [t1.start_draft(), t1.update(_info(served, "draftA")), t1.update(_info(served, "draftB", "layer0"))]
    assert _statuses(steps) == [200, 200, 422]
    assert "(and 10 more tensor(s))" in steps[2].message and "without speculation" in steps[2].message
    assert _never_mixed(served, t1, "after the second refused push") == "QUARANTINED"
    assert _statuses(_push(served, t1, "draftB", "B-next")) == [200] * 4


# ---- bounded inputs -------------------------------------------------------------------------------------------------


def test_a_weight_version_or_push_id_beyond_the_limit_is_refused_422_and_nothing_changes(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    t1, _ = trainers
    _push(served, t1, "draftB", "bounded-1")
    metrics_before = len(t1.metrics_text())
    huge = "v" * (1 << 20)
    for bad in (huge, "step 5", "a\nb", "x" * (LABEL_CAP + 1)):
        refused = t1.post("/update_weight_version", {"new_version": bad})
        assert refused.status == 422 and f"1 to {LABEL_CAP} characters" in refused.message, refused
        assert len(refused.message) < 1000
    assert t1.start_draft().ok and t1.update(_info(served, "draftA")).ok
    refused_id = t1.update(_info(served, "draftA", push_id=huge))
    assert refused_id.status == 422 and "update_info['push_id'] must be 1 to" in refused_id.message
    refused = t1.finish(huge)
    assert refused.status == 422 and f"weight_version must be 1 to {LABEL_CAP} characters" in refused.message
    assert "1,048,576 characters" in refused.message
    assert _draft_state(t1)["state"] == "PARTIALLY_LOADED"  # the push stays open: its finish, corrected, commits
    assert t1.finish("bounded-2").ok
    _committed(served, "draftA", "bounded-2")
    assert t1.weight_version() == "bounded-2" and _never_mixed(served, t1, "bounded") == "DERIVED_REFRESHED"
    assert len(t1.metrics_text()) < metrics_before + 4096  # before: +1 MiB, the version a label


def test_pushes_without_a_weight_version_are_told_apart_by_the_plugins_own_name(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient]) -> None:
    """Issue 32 item 10: SkyRL's and TRL's finishes carry no weight_version; each push is still named, `epoch N`,
    in the audit, the workers' report and /metrics (the canary's periods: test_vllm_online_metrics.py)."""
    t1, _ = trainers
    for draft in ("draftA", "draftB"):
        assert _statuses([t1.start_draft(), t1.update(_info(served, draft)), t1.finish()]) == [200] * 3
        _committed(served, draft, None)
    epoch = _draft_state(t1)["epoch"]
    ((backbone,),) = [list(a["backbones"].values()) for a in t1.rpc("lifecycle_serving_state")]
    assert (backbone["serving_push"], backbone["serving_weight_version"], backbone["open_push"]) == (
        f"epoch {epoch}", None, None)
    ended = [e for e in served["server"].audit_events() if e["event"] == "weight_update_session_ended"][-2:]
    assert [(e["push"], e["weight_version"]) for e in ended] == [(f"epoch {epoch - 1}", None), (f"epoch {epoch}", None)]
    assert t1.metric("reload_lifecycle_weight_version_info", push=f"epoch {epoch}") == 1
    assert t1.metric("reload_lifecycle_weight_version_info", push=f"epoch {epoch - 1}") == 0  # one series
    assert t1.start_draft().ok
    ((backbone,),) = [list(a["backbones"].values()) for a in t1.rpc("lifecycle_serving_state")]
    assert (backbone["serving_push"], backbone["open_push"]) == (f"epoch {epoch}", f"epoch {epoch + 1}")


FORGED_COLLAPSE = {"period": 90, "draft_tokens": 600, "accepted_tokens": 0, "accepted_share": 0.0,
                   "previous_period": 89, "previous_share": 0.9, "engine": 0}


def test_events_sent_over_rpc_are_checked_against_the_audit_schema_and_marked_with_their_origin(
        served: dict[str, Any], trainers: tuple[RLClient, RLClient], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32 item 7: a forged `acceptance_collapse` through the dev route made every audit of the folder exit 2.
    Each event is checked against the auditor's schema before one is written; what is written is marked."""
    from lifecycle.cli import main

    t1, _ = trainers
    server: VllmServer = served["server"]

    def serving_state(events: list[Any]) -> Exchange:
        return t1.post("/collective_rpc", {"method": "lifecycle_serving_state", "kwargs": {"events": events}})

    before = len(server.audit_events())
    for fields, why in (({"period": 1}, "field 'draft_tokens' missing"),
                        ({**FORGED_COLLAPSE, "seq": 1}, "field 'seq' is the writer's"),
                        ({**FORGED_COLLAPSE, "epoch": 0}, "field 'epoch' is the writer's"),
                        ({**FORGED_COLLAPSE, "x": [[[[[[1]]]]]]}, "nested deeper than 4"),
                        ({**FORGED_COLLAPSE, "x": "y" * 5000}, "a string of 5,000 characters"),
                        ({**FORGED_COLLAPSE, "accepted_share": "high"}, "expected a share")):
        refused = serving_state([["acceptance_collapse", "warning", fields]])
        assert refused.status != 200 and why in refused.message, (why, refused.message[:400])
    assert serving_state([["transition", "info", {"trigger": "recover"}]]).status != 200
    assert len(server.audit_events()) == before  # nothing of them was written
    assert serving_state([["acceptance_collapse", "warning", FORGED_COLLAPSE]]).ok  # well formed: written, marked
    (written,) = [e for e in server.audit_events() if e["event"] == "acceptance_collapse" and e["period"] == 90]
    assert written["origin"] == "rpc" and written["seq"] > 0
    code = main(["audit", "--json", str(server.audit_dir)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["input_problem_count"] == 0, doc  # before: exit 2, the forged line an input problem
    (w,) = [w for w in doc["warnings"] if "serving period 90" in w["detail"]]
    assert "[over RPC from the engine's front process]" in w["detail"]


def test_stopping_the_server_audits_the_serving_periods_acceptance_event(served: dict[str, Any]) -> None:
    """Issue 32 item 11: the period being served when the server stops has its `acceptance` event (the last test:
    it stops the module's server)."""
    c: RLClient = served["clients"][0]
    server: VllmServer = served["server"]
    _clean(served)
    assert _statuses(_push(served, c, "draftB", "served-at-stop")) == [200] * 4
    epoch = _draft_state(c)["epoch"]
    for _ in range(3):
        c.complete()  # drafts verified in this period
    time.sleep(0.5)  # the last step's stats reach the front process
    # as a container runtime stops it: SIGTERM to the API server alone, which stops the engine (at once: vLLM's
    # shutdown_timeout 0 kills its processes)
    import psutil

    assert server.proc is not None
    members = server.processes()
    os.kill(server.proc.pid, signal.SIGTERM)
    server.proc.wait(timeout=120)
    psutil.wait_procs(members, timeout=60)  # its children (engine core, worker, resource tracker) end with it
    stopped = server.stop()
    assert stopped.left == [], stopped
    finals = [e for e in server.audit_events() if e["event"] == "acceptance" and e.get("at_stop")]
    assert finals, "no acceptance event for the period served when the server stopped"
    last = finals[-1]
    assert (last["push"], last["weight_version"], last["final"], last["origin"]) == (
        f"epoch {epoch}", "served-at-stop", True, "rpc")
    assert last["draft_tokens"] + last["placeholder_draft_tokens"] > 0 and last["epoch"] == epoch
