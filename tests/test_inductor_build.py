"""The compiler runs of one graph: object files compile side by side, everything else waits for them."""

import threading
import time
from types import SimpleNamespace

import pytest

from optimum_neuronx.backends.inductor.build import compiles_cpp_to_object, objects_compiled_together


def _builder(name, sources, compile_only=True):
    return SimpleNamespace(name=name, _compile_only=compile_only, _sources_args=sources)


@pytest.fixture
def recorded_builds(monkeypatch):
    """CppBuilder.build replaced by a recorder; object compiles block until `release` is set."""
    from torch._inductor import cpp_builder

    log, release, failing = [], threading.Event(), set()

    def build(self):
        log.append(("start", self.name))
        if compiles_cpp_to_object(self):
            assert release.wait(30), "the test never released the compiles"
        if self.name in failing:
            raise RuntimeError(f"compile error in {self.name}")
        log.append(("end", self.name))

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
    return SimpleNamespace(log=log, release=release, failing=failing, build=lambda b: cpp_builder.CppBuilder.build(b))


def _wait_for(condition):
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_wrapper_and_kernels_compile_at_once_and_the_link_waits(recorded_builds):
    from torch._inductor import cpp_builder

    rec, original = recorded_builds, cpp_builder.CppBuilder.build
    with objects_compiled_together():
        rec.build(_builder("wrapper", "/b/g.wrapper.cpp"))  # returns while its compile runs
        rec.build(_builder("kernel", "/b/g.kernel.cpp"))
        _wait_for(lambda: ("start", "kernel") in rec.log and ("start", "wrapper") in rec.log)
        assert not any(event == "end" for event, _ in rec.log)  # both running at the same time
        rec.release.set()
        rec.build(_builder("consts", "/b/g/g.weights.S"))  # read back right after: runs in order, after them
        rec.build(_builder("link", "/b/g.wrapper.o /b/g.kernel.o", compile_only=False))
    order = [event for event in rec.log if event[0] == "end"]
    assert set(order[:2]) == {("end", "wrapper"), ("end", "kernel")}
    assert order[2:] == [("end", "consts"), ("end", "link")]
    assert rec.log.index(("start", "consts")) > rec.log.index(order[1])
    assert cpp_builder.CppBuilder.build is original


@pytest.mark.parametrize("link", [True, False], ids=["at-the-link", "on-leaving"])
def test_a_failed_compile_raises_at_the_next_build_or_on_leaving(recorded_builds, link):
    rec = recorded_builds
    rec.failing.add("kernel")
    rec.release.set()
    with pytest.raises(RuntimeError, match="compile error in kernel"):
        with objects_compiled_together():
            rec.build(_builder("wrapper", "/b/g.wrapper.cpp"))
            rec.build(_builder("kernel", "/b/g.kernel.cpp"))
            if link:
                rec.build(_builder("link", "/b/g.wrapper.o /b/g.kernel.o", compile_only=False))
    assert ("start", "link") not in rec.log  # the link never runs on a failed object
    assert ("end", "wrapper") in rec.log


def test_an_error_inside_waits_for_the_compiles_still_running(recorded_builds):
    rec = recorded_builds
    with pytest.raises(KeyError):
        with objects_compiled_together():
            rec.build(_builder("wrapper", "/b/g.wrapper.cpp"))
            threading.Timer(0.2, rec.release.set).start()
            raise KeyError("lowering failed")
    assert ("end", "wrapper") in rec.log  # waited for, not left running


def test_inductor_builders_are_recognised():
    """The attributes read above are Inductor's: a real CppBuilder for a .cpp -> .o compile, a header and a link."""
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    def real(sources, **options):
        return CppBuilder(name="g", sources=sources, output_dir="/tmp", BuildOption=CppOptions(**options))

    assert compiles_cpp_to_object(real("/b/g.kernel.cpp", compile_only=True))
    assert not compiles_cpp_to_object(real("/b/g.weights.S", compile_only=True))
    assert not compiles_cpp_to_object(real(["/b/g.wrapper.o", "/b/g.kernel.o"]))
    assert not compiles_cpp_to_object(real("/b/header.h", precompiling=True))
