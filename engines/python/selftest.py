"""Checks the engine's state and DELTA delivery end to end: engines/python/run.sh --help >/dev/null && engines/python/.venv/bin/python engines/python/selftest.py"""

import os
import signal
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "gen"))

import grpc  # noqa: E402

from contextengine.v1 import engine_pb2 as pb  # noqa: E402
from contextengine.v1 import engine_pb2_grpc as pb_grpc  # noqa: E402
from contextengine.v1 import types_pb2 as types  # noqa: E402

SID = "selftest-session"


def start(state_dir):
    p = subprocess.Popen([os.path.join(here, "run.sh"), "--listen", "127.0.0.1:0", "--state-dir", state_dir],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("listening on "), line
    channel = grpc.insecure_channel(line.split()[-1])
    return p, channel, pb_grpc.ContextEngineStub(channel)


def stop(p, channel, sig=signal.SIGTERM):
    channel.close()
    p.send_signal(sig)
    p.wait(timeout=20)


def user(i, text):
    return types.AgentMessage(id=i, role=types.ROLE_USER, content=[types.ContentPart(text=text)])


def assistant(i, text):
    return types.AgentMessage(id=i, role=types.ROLE_ASSISTANT, content=[types.ContentPart(text=text)])


def assemble(c, messages, cursor=None, sid=SID):
    r = pb.AssembleRequest(session_id=sid, messages=messages)
    if cursor is not None:
        r.cursor.CopyFrom(cursor)
    return c.Assemble(r, timeout=10)


def commit(c, key, messages):
    anchor = types.TranscriptEntryAnchor(session_id=SID, entry_id=messages[-1].id)
    return c.CommitTurn(pb.CommitTurnRequest(
        session_id=SID, advancement_key=key, messages=messages, terminal=anchor,
        admission=types.TranscriptTurnAdmission(anchor=anchor, logical_turn_id=key, role=types.ROLE_USER)),
        timeout=10).status


def gap_of(err):
    """The HistoryGap of a FAILED_PRECONDITION, from grpc-status-details-bin."""
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    raw = dict(err.trailing_metadata() or ())["grpc-status-details-bin"]
    status = pb.RpcStatus.FromString(raw)
    assert status.code == 9 and status.message == err.details(), status
    [detail] = status.details
    assert detail.type_url == "type.googleapis.com/contextengine.v1.HistoryGap", detail
    return pb.HistoryGap.FromString(detail.value)


def expect_gap(c, cursor, messages=()):
    try:
        assemble(c, list(messages), cursor)
    except grpc.RpcError as e:
        return gap_of(e)
    raise AssertionError(f"no gap for {cursor}")


def search(c, arguments_json):
    return c.CallTool(pb.CallToolRequest(session_id=SID, tool_call_id="t1", name="history_search",
                                         arguments_json=arguments_json), timeout=10)


def ids(result):
    return [m.id for m in result.messages]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        p, ch, c = start(state)
        info = c.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.history_delivery == pb.HISTORY_DELIVERY_DELTA, info
        assert "IngestBatch" in info.implemented_methods and "ForgetSession" in info.implemented_methods

        m1, m2, m3, m4 = user("m1", "hello there"), assistant("m2", "hi"), user("m3", "next"), assistant("m4", "ok")
        n = c.IngestBatch(pb.IngestBatchRequest(session_id=SID, messages=[m1, m2]), timeout=10).ingested_count
        assert n == 2, n
        n = c.IngestBatch(pb.IngestBatchRequest(session_id=SID, messages=[m1, m2]), timeout=10).ingested_count
        assert n == 0, n

        at2 = pb.HistoryCursor(message_id="m2", seq=2, message_count=2)
        r = assemble(c, [m3], at2)
        assert ids(r) == ["m1", "m2", "m3"] and r.estimated_tokens > 0, r
        r = assemble(c, [m2, m3], at2)  # a message already held is not repeated
        assert ids(r) == ["m1", "m2", "m3"], r
        r = assemble(c, [user("x1", "fresh")], pb.HistoryCursor())  # empty cursor: nothing assumed
        assert ids(r) == ["m1", "m2", "x1"], r
        r = assemble(c, [m3])  # no cursor: the request is the whole history
        assert ids(r) == ["m3"], r
        print("assemble with a cursor: ok")

        gap = expect_gap(c, pb.HistoryCursor(message_id="nope", seq=9, message_count=9), [m3])
        assert gap.held.message_id == "m2" and gap.held.seq == 2 and gap.held.message_count == 2, gap
        assert gap.held.tokens == 4, gap  # "hello there" 3 tokens, "hi" 1
        gap = expect_gap(c, pb.HistoryCursor(message_id="m2", seq=2, message_count=5))
        assert gap.held.message_count == 2, gap
        try:
            assemble(c, [], pb.HistoryCursor(message_id="m1", message_count=1), sid="other")
            raise AssertionError("no gap for an unknown session")
        except grpc.RpcError as e:
            assert gap_of(e).held == pb.HistoryCursor(), e
        print("history gap detail: ok,", " ".join(str(gap.held).split()))

        assert commit(c, "turn-1", [m3, m4]) == pb.COMMIT_STATUS_COMMITTED
        assert commit(c, "turn-1", [m3, m4]) == pb.COMMIT_STATUS_DUPLICATE
        stop(p, ch, signal.SIGKILL)  # a crash, not a drain

        p, ch, c = start(state)
        assert commit(c, "turn-1", [m3, m4]) == pb.COMMIT_STATUS_DUPLICATE
        r = assemble(c, [user("m5", "after the restart")], pb.HistoryCursor(message_id="m4", seq=4, message_count=4))
        assert ids(r) == ["m1", "m2", "m3", "m4", "m5"], r
        print("commit and messages survive a kill -9: ok")

        turns = [m for k in range(3, 7) for m in (user(f"m{2 * k - 1}", f"question {k}"),
                                                   assistant(f"m{2 * k}", f"answer {k}"))]
        c.IngestBatch(pb.IngestBatchRequest(session_id=SID, messages=turns), timeout=10)
        events = list(c.Compact(pb.CompactRequest(session_id=SID, session_key=SID, force=True), timeout=30))
        result = events[-1].result
        assert result.compacted and result.first_kept_entry_id == "m9", events[-1]
        stop(p, ch)
        p, ch, c = start(state)
        r = assemble(c, [user("m13", "now")], pb.HistoryCursor(message_id="m12", seq=12, message_count=12))
        assert ids(r) == [f"py-summary:{SID}", "m9", "m10", "m11", "m12", "m13"], ids(r)
        assert "hello there" in r.messages[0].content[0].text and "question 4" in r.messages[0].content[0].text
        print("summary survives a restart: ok")

        assert [t.name for t in info.tools] == ["history_search"] and "CallTool" in info.implemented_methods
        hits = search(c, '{"query": "hello question", "limit": 3}')
        assert not hits.is_error and len(hits.content[0].text.splitlines()) == 3, hits
        assert hits.content[0].text.startswith("seq 1 (user): [hello] there"), hits  # summarised messages too
        assert "[question]" in hits.content[0].text, hits
        for bad in ('not json', '[]', '{}', '{"query": "  "}', '{"query": "x", "limit": 0}', '{"query": "x", "limit": "2"}'):
            assert search(c, bad).is_error, bad
        print("history_search: ok")

        c.ForgetSession(pb.ForgetSessionRequest(session_id=SID), timeout=10)
        c.ForgetSession(pb.ForgetSessionRequest(session_id=SID), timeout=10)  # idempotent
        assert "no message" in search(c, '{"query": "question"}').content[0].text, "forgotten from the index too"
        n = c.IngestBatch(pb.IngestBatchRequest(session_id=SID, messages=[m1, m2, m3]), timeout=10).ingested_count
        assert n == 3, n
        assert commit(c, "turn-1", [m3, m4]) == pb.COMMIT_STATUS_COMMITTED
        r = assemble(c, [m4], pb.HistoryCursor(message_id="m3", seq=3, message_count=3))
        assert ids(r) == ["m1", "m2", "m3", "m4"], r  # no summary left either
        print("forget session: ok")

        try:
            c.IngestBatch(pb.IngestBatchRequest(session_id=" ", messages=[m1]), timeout=10)
            raise AssertionError("blank session id accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("session_id"), e
        stop(p, ch)
    print("selftest passed")


if __name__ == "__main__":
    main()
