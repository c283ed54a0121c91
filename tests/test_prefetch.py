"""Reads in one round trip (host/prefetch.py): the batch script run for real by bash on this
machine answers each read exactly as the read alone would (output without a final newline,
binary bytes, stderr, exit codes, stdin), in one remote call; a reads pass answers from it,
remembers what it lacks, and refuses what is not a read."""

from __future__ import annotations

import pytest

from playbooks.errors import HostError
from playbooks.host.local import LocalHost
from playbooks.host.prefetch import Call, NotARead, Reads, batch_script, parse_batch

CALLS = [
    Call("printf 'no newline'"),
    Call("printf '\\000\\377binary'; echo err >&2; exit 3"),
    Call("cat", stdin=b"fed on stdin\n\x00"),
    Call("echo $GREETING", env=(("GREETING", "hello world"),)),
    Call("sleep 5", timeout=0.2),
    Call("cat"),  # no stdin: /dev/null, never the script itself
    Call("false | true"),  # pipefail, as alone
    Call('echo "[$vf_batch_t][${LC_ALL}]"; exit 4'),  # the batch's variables unseen, the locale set
    Call("echo 'unterminated"),  # a broken read is its own failure, not the batch's
]


def test_a_batch_answers_each_read_as_it_would_run_alone(tmp_path):
    host = LocalHost()
    alone = [
        host._run(
            c.command,
            sudo=False,
            check=False,
            stream=False,
            env=dict(c.env),
            timeout=c.timeout,
            stdin=c.stdin,
            raw=True,
        )
        for c in CALLS[:4] + CALLS[5:]
    ]
    calls_before = host.remote_calls
    reads = Reads()
    host.fetch_reads(reads, CALLS)
    assert host.remote_calls == calls_before + 1
    got = [reads.answers[c] for c in CALLS]
    for (out, err, code), (a_out, a_err, a_code) in zip(got[:4] + got[5:], alone, strict=True):
        if a_code == 2 and "unexpected EOF" in a_err:
            # a broken read: the same failure; bash names the shell that parsed it (eval, -c)
            assert (out, code) == (a_out, a_code) and "unexpected EOF" in err.decode()
            continue
        assert (out, err.decode(), code) == (a_out, a_err, a_code)
    assert got[0] == (b"no newline", b"", 0) and got[1] == (b"\x00\xffbinary", b"err\n", 3)
    assert got[2][0] == b"fed on stdin\n\x00" and got[3][0] == b"hello world\n" and got[5] == (b"", b"", 0)
    assert got[4][2] == 124  # the timeout kills it on the host, as alone


def test_a_reads_pass_answers_from_the_batch_and_remembers_its_misses():
    host = LocalHost()
    reads = Reads()
    host.fetch_reads(reads, [Call("echo known")])
    before = host.remote_calls
    with host.reading(reads):
        assert host.run("echo known", stream=False).stdout == "known\n"
        assert host.run("echo unknown", stream=False, check=False).stdout == ""
        with pytest.raises(NotARead):
            host.run("touch /tmp/x")  # streams: a command, not a read
        with pytest.raises(NotARead):
            host.write_file("/tmp/vf-never-written", b"x", 0o644)
    assert host.remote_calls == before and reads.misses == [Call("echo unknown")]


def test_a_batch_cut_short_is_one_clear_error():
    script, marker = batch_script([Call("echo a"), Call("echo b")], [False, False], marker="VF-0123456789abcdef")
    whole = b"VF-0123456789abcdef codes 0 3\nVF-0123456789abcdef sizes 2 0 2 1 \na\nb\nx"
    assert parse_batch(whole, marker, 2) == [(b"a\n", b"", 0), (b"b\n", b"x", 3)]
    with pytest.raises(HostError, match="without their header"):
        parse_batch(whole[:30], marker, 2)
    with pytest.raises(HostError, match="without their header"):
        parse_batch(whole.replace(b"0123", b"9999"), marker, 2)
    with pytest.raises(HostError, match="2 exit codes for 3 reads"):
        parse_batch(whole, marker, 3)
    with pytest.raises(HostError, match="cut short in read 2 of 2"):
        parse_batch(whole[:-1], marker, 2)


def test_known_reads_round_trip_and_a_broken_record_is_an_empty_start(tmp_path):
    import os
    import time

    from playbooks.conduct.known_reads import KEEP_DAYS, KnownReads

    calls = [Call("cat /x"), Call("python3 -", stdin=b"print(1)\n\x00"), Call("e", True, (("A", "b c"),), 5.0)]
    known = KnownReads(tmp_path / "reads" / "box-0123.json")
    assert known.load() == []  # none yet
    stale = tmp_path / "reads" / "gone-4567.json"
    stale.parent.mkdir()
    stale.write_text("{}")
    past = time.time() - (KEEP_DAYS + 1) * 86400
    os.utime(stale, (past, past))
    known.save(calls)
    assert known.load() == calls and oct(known.path.stat().st_mode & 0o777) == "0o600"
    assert not stale.exists()  # a record unused for KEEP_DAYS is dropped
    for broken in ("{", '{"version": 99, "calls": []}', '{"version": 1, "calls": [{"sudo": true}]}'):
        known.path.write_text(broken)
        assert known.load() == []
