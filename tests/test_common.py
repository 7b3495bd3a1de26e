"""common/: the CLI toolkit (one-line parser, bounded arguments, output paths) and safe writes (atomic, locked)."""
from __future__ import annotations

import json
import re
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from common.cli import Parser, float_in, float_list, int_in, int_list, output_dir, output_file, safe_name
from common.errors import UserError, cli_entry
from common.io import DirLock, atomic_write, json_text, remove_owned


def test_parser_error_is_one_line_exit_2(capsys):
    p = Parser(prog="x")
    p.add_argument("--n", type=int_in(1, 10))

    @cli_entry
    def main(argv=None):
        p.parse_args(argv)

    with pytest.raises(SystemExit) as e:
        main(["--n", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage" not in err and "--n" in err and "1..10" in err


@pytest.mark.parametrize("s", ["0", "11", "1.5", "nan", "", "1e3", "1_0", "\uff15", "0x5"])
def test_int_in_refuses(s):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        int_in(1, 10)(s)


def test_int_in_accepts_bounds():
    assert int_in(1, 10)("1") == 1 and int_in(1, 10)(" 10 ") == 10 and int_in(0)("123456789") == 123456789


@pytest.mark.parametrize("s", ["nan", "inf", "-inf", "x", "-0.1", "2"])
def test_float_in_refuses(s):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        float_in(0, 1)(s)


def test_float_in_open_ends():
    import argparse
    assert float_in(0, 1)("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError):
        float_in(0, 1, lo_open=True)("0")
    assert float_in(0, lo_open=True)("1e9") == 1e9


def test_lists():
    assert int_list("0, 8,8,32", "--d", 0, 256) == [0, 8, 32]
    for bad in ("", ",", "1.7", "nan", "-1", "300"):
        with pytest.raises(UserError):
            int_list(bad, "--d", 0, 256)
    assert float_list("0.1,1", "--a", 0) == [0.1, 1.0]
    with pytest.raises(UserError):
        float_list("0.1,nan", "--a")


def test_output_paths(tmp_path):
    with pytest.raises(UserError, match="empty"):
        output_dir("")
    with pytest.raises(UserError, match="empty"):
        output_file("  ")
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        output_dir(f)
    with pytest.raises(UserError, match="not a directory"):
        output_dir(f / "sub")
    with pytest.raises(UserError, match="is a directory"):
        output_file(tmp_path)
    assert output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checking creates nothing
    if Path("/proc").is_dir():
        with pytest.raises(UserError):
            output_dir("/proc/x")
        with pytest.raises(UserError):
            output_file("/proc/x/y.json")


def test_safe_name(tmp_path):
    assert safe_name("tiny-fbt") == "tiny-fbt"
    assert safe_name("checkpoints/tiny-fbt/") == "tiny-fbt"
    d = tmp_path / "m" / "inner"
    d.mkdir(parents=True)
    assert safe_name(f"{d}/..") == "m"
    assert ".." not in safe_name("..") and safe_name("..") != ""
    with pytest.raises(UserError):
        safe_name("/")


def test_atomic_write_cleans_up_on_interrupt(tmp_path):
    p = tmp_path / "r.json"
    atomic_write(p, "old")

    def boom(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(p, boom)
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
    atomic_write(p, b"new")
    assert p.read_bytes() == b"new"


def test_json_text_refuses_nan():
    assert json.loads(json_text({"a": 1.0})) == {"a": 1.0}
    with pytest.raises(ValueError):
        json_text({"a": float("nan")})


def _try_lock(path, q):
    try:
        with DirLock(path):
            q.put("got it")
    except UserError as e:
        q.put(f"refused: {e}")


def test_dir_lock_refuses_a_second_process_and_leaves_no_file(tmp_path):
    d = tmp_path / "out"
    with DirLock(d) as lock:
        assert lock.created
        q = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=_try_lock, args=(d, q))
        p.start()
        p.join(30)
        assert q.get(timeout=5).startswith("refused: another run is writing")
    assert list(d.iterdir()) == []
    with DirLock(d):  # released
        pass


def test_dir_lock_removes_the_directory_it_made_on_failure(tmp_path):
    d = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with DirLock(d):
            raise RuntimeError
    assert not d.exists()
    d.mkdir()
    with pytest.raises(RuntimeError):
        with DirLock(d):
            raise RuntimeError
    assert d.exists()  # not ours to remove


def test_remove_owned(tmp_path):
    (tmp_path / "activations").mkdir()
    (tmp_path / "activations" / "a.npz").write_text("x")
    (tmp_path / "probes.json").write_text("x")
    (tmp_path / "causal_report.json").write_text("x")
    remove_owned(tmp_path, ["probes.json", "activations", "missing"], keep=("probes.json",))
    assert sorted(os.listdir(tmp_path)) == ["causal_report.json", "probes.json"]


def test_output_file_directly_under_a_pseudo_file_system():
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(UserError):
        output_file("/proc/x")


def test_position_list():
    from common.cli import position_list

    assert position_list("T, T-1,-5,t-1", "--p", 10) == [-1, -2, -5]
    for bad in ("T-10", "0", "x", "-11", ","):
        with pytest.raises(UserError) as e:
            position_list(bad, "--p", 10)
        assert str(e.value).startswith("--p ") and "\n" not in str(e.value)


def test_cli_entry_prints_one_line_whatever_the_message(capsys):
    import pytest

    from common.errors import UserError, cli_entry

    @cli_entry
    def main(argv=None):
        raise UserError("a user's code said\nboom\n\n  on three lines")

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and capsys.readouterr().err == "error: a user's code said; boom; on three lines\n"


def test_cli_entry_says_a_full_disk_in_one_line(tmp_path, capsys):
    """A write refused by the machine (ENOSPC) mid-run is one line and exit 1, after the run's own cleanup (no
    temporary left); any other OSError is still a bug's traceback."""
    import errno

    @cli_entry
    def main(argv=None):
        def write(tmp):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        atomic_write(tmp_path / "results.json", write)

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 1 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == "error: a write failed: No space left on device\n"

    @cli_entry
    def other(argv=None):
        raise OSError(errno.EBADF, "a bug")

    with pytest.raises(OSError):
        other([])


def test_cli_entry_says_safetensors_full_disk_in_one_line(capsys):
    """safetensors' writer (a checkpoint's weights, the trainer state) reports a full disk as its own
    SafetensorError naming the OS error: one line too; its other errors stay tracebacks."""
    from safetensors import SafetensorError

    @cli_entry
    def main(argv=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 1 and capsys.readouterr().err == "error: a write failed: No space left on device\n"

    @cli_entry
    def chained(argv=None):  # a library that re-raises the OSError as its own error
        try:
            raise OSError(28, "No space left on device", "/x/model.safetensors")
        except OSError as err:
            raise RuntimeError("could not save") from err

    with pytest.raises(SystemExit) as e:
        chained([])
    assert e.value.code == 1  # the file named by the OSError the library's error was raised from
    assert capsys.readouterr().err == "error: a write failed: No space left on device (/x/model.safetensors)\n"

    @cli_entry
    def other(argv=None):
        raise SafetensorError("Error while deserializing header: HeaderTooLarge")

    with pytest.raises(SafetensorError):
        other([])


def test_cli_entry_keeps_a_bug_raised_while_a_full_disk_unwinds():
    """An error raised while handling a full disk (a cleanup's own bug, an error raised `from None`) is that bug's
    traceback, not 'a write failed': only an exception raised *from* the OSError stands for it."""
    import errno

    @cli_entry
    def cleanup_bug(argv=None):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/results.json")
        finally:
            {}["tmp"]  # the cleanup's bug: hidden behind the full disk's one line

    with pytest.raises(KeyError):
        cleanup_bug([])

    @cli_entry
    def suppressed(argv=None):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise ValueError("a bug in the fallback") from None

    with pytest.raises(ValueError):
        suppressed([])


def test_cli_entry_leaves_a_sigterm_handler_installed_mid_run_alone():
    """A library that installs its own SIGTERM handler during the run keeps it: cli_entry puts the default action
    back only over its own handler."""
    import signal

    def theirs(signum, frame):
        pass

    @cli_entry
    def main(argv=None):
        signal.signal(signal.SIGTERM, theirs)
        return 0

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert main([]) == 0 and signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_sigterm_lets_the_first_ones_cleanup_finish(capsys):
    """A scheduler signals every process of a job and torchrun forwards its own SIGTERM to its workers: a worker
    gets two, the second while the first's cleanup (a staging folder's removal) runs. It must not cut that cleanup
    short (a --overwrite training run left its staging folder, a checkpoint in it)."""
    import signal

    done = []

    @cli_entry
    def main(argv=None):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the second one, mid-cleanup
            for _ in range(1000):
                pass
            done.append(True)

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as e:
            main([])
        assert e.value.code == 143 and done == [True] and capsys.readouterr().err == "terminated\n"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cli_entry_turns_sigterm_into_an_interrupt_with_cleanup(tmp_path, capsys):
    """SIGTERM (a scheduler's stop) runs the same cleanup as Ctrl-C (Python's default action skips every finally:
    temporaries, staging folders and a folder the run made were left behind): 'terminated', exit 143; the
    default action is back afterwards, and a handler someone else installed is left alone."""
    import signal

    def write(tmp):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered while the temporary exists
        for _ in range(1000):  # the handler runs between bytecodes
            pass
        raise AssertionError("SIGTERM was not raised")

    @cli_entry
    def main(argv=None):
        atomic_write(tmp_path / "results.json", write)

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as e:
            main([])
        assert e.value.code == 143 and capsys.readouterr().err == "terminated\n"
        assert list(tmp_path.iterdir()) == []  # atomic_write removed its temporary
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

        seen = []
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # a host program's own handler

        @cli_entry
        def hosted(argv=None):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
            return 0

        assert hosted([]) == 0 and seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("rank, local, said", [(None, None, True), ("0", "0", True), ("1", "1", False),
                                               ("3", "1", False), ("2", "0", True)])
def test_a_refusal_under_torchrun_is_said_once_a_node(monkeypatch, capsys, rank, local, said):
    """torchrun's processes all check the same command line before the group is up: the first process of each node
    prints the refusal (a node may refuse what another accepts: no GPU there); every process still exits 2."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun sets it: one process alone always says its refusal
    for name, v in (("RANK", rank), ("LOCAL_RANK", local)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)

    @cli_entry
    def main(argv=None):
        raise UserError("bad flag")

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and capsys.readouterr().err == ("error: bad flag\n" if said else "")


def test_dir_lock_left_with_an_error_removes_the_empty_folders_it_made(tmp_path):
    """A refusal inside the lock (a check that needs the data) leaves no folder behind, parents included; what
    holds a file, and what existed before, stays."""
    with pytest.raises(UserError):
        with DirLock(tmp_path / "figures" / "model" / "task"):
            raise UserError("refused")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "figures").mkdir()
    with pytest.raises(UserError):
        with DirLock(tmp_path / "figures" / "model" / "task") as lock:
            (lock.dir / "partial.json").write_text("{}")
            raise UserError("failed")
    assert (tmp_path / "figures" / "model" / "task" / "partial.json").is_file()
    with DirLock(tmp_path / "figures" / "other"):  # left without an error: the run's folder stays
        pass
    assert (tmp_path / "figures" / "other").is_dir()


def test_save_tokenizer_takes_a_path_as_text(tmp_path):
    from models.full_bandwidth import save_tokenizer
    from tasks import build_tokenizer

    save_tokenizer(build_tokenizer(), str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file() and not list(tmp_path.glob(".*.tmp"))


def test_given_flags_names_what_the_line_names_whatever_its_value():
    from common.cli import given_flags

    p = Parser(prog="x")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--flag", action="store_true")
    p.add_argument("--name", default="a")
    assert given_flags(p, []) == set()
    assert given_flags(p, ["--seq-len", "64", "--flag"]) == {"seq_len", "flag"}  # a default's own value too
    assert given_flags(p, ["--seq=3", "--name", "a"]) == {"seq_len", "name"}  # abbreviations, --x=v
    assert p.parse_args([]).seq_len == 64  # the parser's defaults are left as they were


def test_an_empty_model_is_refused_by_name_everywhere(capsys):
    """--model '' (or an empty positional MODEL) is refused as empty, not read as the folder '.'."""
    from common.cli import add_model_flag

    for positional in (False, True):
        p = Parser(prog="x")
        add_model_flag(p, positional=positional)

        @cli_entry
        def main(argv=None):
            p.parse_args(argv)

        with pytest.raises(SystemExit):
            main(["  "] if positional else ["--model", ""])
        assert "is empty: give a shipped preset's name or a model directory" in capsys.readouterr().err


def _lock_many(root, n, barrier, q):
    from common.errors import UserError
    from common.io import DirLock

    barrier.wait()
    errors = {"refused": 0, "other": []}
    for i in range(n):
        try:
            with DirLock(f"{root}/p{i}/out"):
                pass
        except UserError:
            errors["refused"] += 1
        except Exception as e:  # noqa: BLE001 - what the test counts
            errors["other"].append(repr(e))
    q.put(errors)


def test_two_runs_making_the_same_new_folders_at_once_never_crash():
    """DirLock made its missing folders with one mkdir(parents=True): a second run making the same folder at the
    same moment got FileExistsError (26 times in 600 tries). Each folder is made alone now, and another run's
    making it is not an error."""
    import multiprocessing as mp
    import tempfile

    root = tempfile.mkdtemp()
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_lock_many, args=(root, 300, barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [r["other"] for r in results] == [[], []], results


def test_a_lock_taken_on_a_folder_removed_meanwhile_is_taken_again_on_the_new_one(tmp_path, monkeypatch):
    """A failed run removes the empty folder it made: a run that opened it just before holds a lock on a removed
    folder, and would write into nothing. It notices and locks the folder as it is now."""
    import os

    from common.io import DirLock

    d = tmp_path / "out"
    real_open, calls = os.open, []

    def racing_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if str(path) == str(d) and not calls:  # the first time: another run's cleanup removes it right after
            calls.append(1)
            os.rmdir(d)
        return fd

    monkeypatch.setattr(os, "open", racing_open)
    with DirLock(d) as lock:
        assert d.is_dir() and os.path.samestat(os.fstat(lock.fd), os.stat(d))


@pytest.mark.parametrize("env, refusal", [
    ({"RANK": "1"}, "RANK / LOCAL_RANK set (1 / None) without WORLD_SIZE"),  # was: rank 1 of 1, a run that wrote nothing
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 with RANK=None"),
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "WORLD_SIZE=2 with RANK=2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
])
def test_torchrun_s_environment_is_checked_and_refused_in_one_line(monkeypatch, capsys, env, refusal):
    from common.distributed import env_place
    from common.errors import UserError, cli_entry

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=re.escape(refusal)):
        env_place()

    @cli_entry
    def main(argv=None):
        env_place()

    with pytest.raises(SystemExit) as e:  # said, even by a process whose RANK is not 0 (no torchrun: nobody else)
        main([])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")


def test_torchrun_s_places_and_a_refusal_said_by_rank_0(monkeypatch, capsys):
    from common.distributed import SaidElsewhere, env_place
    from common.errors import cli_entry

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert env_place() == (1, 0, 0)
    monkeypatch.setenv("RANK", "0")
    assert env_place() == (1, 0, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert env_place() == (4, 3, 3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_place() == (4, 3, 1)

    @cli_entry
    def main(argv=None):
        raise SaidElsewhere("rank 0 says it")

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_interventions_run_refuses_torchrun_before_any_work(monkeypatch, capsys, tmp_path):
    from interventions.run import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny-fbt", "--task", "parity", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "runs in one process" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
