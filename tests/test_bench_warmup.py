"""benchmarks/recirculation.py (both sections) and benchmarks/cold_step.py run every arm once untimed before their timed
rounds: at one repeat no timed arm is the process's first call of its kind. Spies record, for every call of an
arm, whether it ran inside the script's timer; the first call of each arm must not. Tiny sizes: seconds."""
from __future__ import annotations

from test_cli_toolkit import _load


def _timer_spy(mod, name, state):
    real = getattr(mod, name)

    def timed(fn):
        state["timing"] = True
        try:
            return real(fn)
        finally:
            state["timing"] = False
    return timed


def test_recirculation_generation_arms_are_warmed_before_they_are_timed(monkeypatch, capsys):
    mod = _load("benchmarks/recirculation.py")
    state, calls = {"timing": False}, []
    monkeypatch.setattr(mod, "_time", _timer_spy(mod, "_time", state))
    real_generate, real_rgenerate = mod.generate, mod.RecirculatedLM.generate

    def generate(model, prompt, pm, n, decoding, *args, **kw):
        calls.append((("base", n), state["timing"]))
        return real_generate(model, prompt, pm, n, decoding, *args, **kw)

    def rgenerate(self, prompt, pm, n, *args, **kw):
        calls.append((("recirculated", n), state["timing"]))
        return real_rgenerate(self, prompt, pm, n, *args, **kw)

    monkeypatch.setattr(mod, "generate", generate)
    monkeypatch.setattr(mod.RecirculatedLM, "generate", rgenerate)
    mod.main(["--repeats", "1", "--prompt-len", "4", "--new-tokens", "3", "--prefill-len", "4", "--passes", "1",
              "--threads", "1"])
    arms = {arm for arm, _ in calls}
    assert arms == {("base", 3), ("base", 1), ("recirculated", 3), ("recirculated", 1)}
    for arm in arms:
        timings = [t for a, t in calls if a == arm]
        assert timings[0] is False and True in timings, (arm, timings)
    assert '"gen_latency_ratio"' in capsys.readouterr().out.splitlines()[-1]


def test_recirculation_prefill_arms_are_warmed_before_they_are_timed(monkeypatch):
    mod = _load("benchmarks/recirculation.py")
    state, calls = {"timing": False}, []
    monkeypatch.setattr(mod, "_time", _timer_spy(mod, "_time", state))
    real_prefill = mod.RecirculatedLM.prefill

    def prefill(self, x, xm, engine, *args, **kw):
        if x.shape[1] == 5:  # section 2's prompt (section 1's is 4 tokens long)
            calls.append(((engine, kw.get("passes")), state["timing"]))
        return real_prefill(self, x, xm, engine, *args, **kw)

    monkeypatch.setattr(mod.RecirculatedLM, "prefill", prefill)
    mod.main(["--repeats", "1", "--prompt-len", "4", "--new-tokens", "3", "--prefill-len", "5", "--passes", "1,2",
              "--threads", "1"])
    arms = {arm for arm, _ in calls}
    assert arms == {("sequential", None), ("blockwise", 1), ("blockwise", 2)}
    for arm in arms:
        timings = [t for a, t in calls if a == arm]
        assert timings == [False, True], (arm, timings)


def test_cold_step_arms_are_warmed_before_they_are_timed(monkeypatch, capsys):
    mod = _load("benchmarks/cold_step.py")
    import models.lean_step as lean

    state, bundle_calls, step_calls = {"timing": False}, [], []
    monkeypatch.setattr(mod, "timed", _timer_spy(mod, "timed", state))
    real_step, real_linear = mod.recurrent_step, mod.F.linear

    def recurrent_step(*args, **kw):
        step_calls.append(("lean" if lean._ON[0] else "hf", state["timing"]))
        return real_step(*args, **kw)

    class F:  # the bundle's ops go through the module's F
        @staticmethod
        def linear(*args, **kw):
            bundle_calls.append(state["timing"])
            return real_linear(*args, **kw)

    monkeypatch.setattr(mod, "recurrent_step", recurrent_step)
    monkeypatch.setattr(mod, "F", F)
    mod.main(["--rounds", "1", "--ops", "3", "--T", "8", "--gap-ms", "1"])
    assert bundle_calls[0] is False and True in bundle_calls
    for kind in ("lean", "hf"):
        timings = [t for k, t in step_calls if k == kind]
        assert timings[:2] == [False, False] and timings[2:] == [True, True], (kind, timings)
    assert '"step_ms"' in capsys.readouterr().out.splitlines()[-1]
