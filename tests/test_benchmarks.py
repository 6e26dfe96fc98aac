"""The benchmarks run end to end (smoke mode, tiny model); their numbers are not judged here."""

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO


def run_benchmark(
    script: str, *args: str, timeout: int, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python <script> <args>`` from the repository; it must succeed."""
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_engine_benchmark_smoke(tiny_model_dir):
    result = run_benchmark(
        "benchmarks/engine.py",
        "--model-dir",
        str(tiny_model_dir),
        "--steps",
        "12",
        "--requests",
        "1",
        "--rounds",
        "1",
        "--seeds",
        "1",
        "--decoder-dtype",
        "int8",
        "--json",
        "--max-seconds",
        "300",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert data["baseline"]["ms_per_step"] > 0
    assert data["ours"]["decoder_dtype"] == "int8"  # the timed runs on the int8 decoder
    assert set(data["ours"]["concurrency"]) == {"1", "4", "8", "16"}
    for level in data["ours"]["concurrency"].values():  # the time rows waited on decoding
        assert 0 < level["decode_share"] < 1
    assert 0 <= data["fidelity"]["top1_agreement"] <= 1
    readings = data["ours"]["bandwidth_readings_gb_per_s"]
    assert len(readings) == 2 and data["ours"]["bandwidth_gb_per_s"] == max(readings) > 0
    reads = data["ours"]["weights_read_ms"]  # the packed layers read alone, before and after
    assert len(reads) == 2 and min(reads) > 0
    by_sum = data["ours"]["gpt_linear_mb"] / data["ours"]["bandwidth_gb_per_s"]
    assert data["ours"]["floor_ms"] == min(by_sum, *reads)
    assert data["ours"]["kernel_tuning"].startswith(("prefetch", "no software prefetch"))
    products = data["ours"]["products_ms"]  # from memory and from cache, less the calls' cost
    assert set(products) == {"1", "8"}
    assert all(set(row) == {"memory", "cache", "call_fixed"} for row in products.values())
    assert all(row["call_fixed"] > 0 for row in products.values())
    from benchmarks.engine import report

    text = report(data)
    assert "batch-1 step within 1.3x" in text and "8-row step within 2.5x" in text
    assert "a loop only reading them took" in text and "with the weights in cache" in text
    assert "decode share at 8 concurrent < 20%" in text and "decoded as one batch" in text
    fidelity = data["fidelity"]
    assert 0 < fidelity["int8_decoder_relative_l2"] < 0.1  # the int8 decoder's own error
    assert "fp32 vs int8 decoder" in text and "int8 decoder;" in text
    assert fidelity["bf16_batched_vs_alone_relative_l2"] < 0.05
    assert fidelity["bf16_batched_vs_fp32_relative_l2"] < 0.05
    assert data["ours"]["kernel_tuning"] in text and data["cpu"] in text
    arithmetic = data["ours"]["arithmetic"]  # what the instructions allow, from registers
    # the bf16 decoder's products' peak too, where the CPU has AVX512-BF16
    bf16 = {"bf16"} if "avx512_bf16" in data["cpu_flags"] else set()
    assert set(arithmetic["peak_gmac_per_s"]) == {arithmetic["product"], "fp32", *bf16}
    assert all(rate > 0 for rate in arithmetic["peak_gmac_per_s"].values())
    readings = arithmetic["peak_readings_gmac_per_s"]  # before and after the runs: the higher
    assert len(readings) == 2
    assert all(
        rate == max(r[loop] for r in readings)
        for loop, rate in arithmetic["peak_gmac_per_s"].items()
    )
    assert arithmetic["gpt_macs_per_row"] > 0 and arithmetic["decode_macs"] > 0
    assert "arithmetic (from registers" in text and "a decode share of at least" in text
    decode_at_bf16 = re.search(r"; bf16 [\d.]+ s, a decode share of at least \d+%", text)
    assert ("bf16 pairs" in text) == bool(bf16) == (decode_at_bf16 is not None)
    # what the hypervisor took while each side ran (the ratios compare two runs)
    for phase in ("baseline", "ours", "fidelity"):
        assert 0 <= data[phase]["steal_share"] <= 1
    assert "steal: the hypervisor took" in text and "while the baseline ran" in text


def test_decode_multiply_adds_count_every_layer_whatever_runs_it(tiny_model_dir):
    """The engine benchmark's decode bound counts the same multiply-adds for a decoder whose
    linear layers run on oneDNN's fused bias (bf16) or whose depthwise convolutions run on
    the kernels (fp32 and bf16, where they give torch's bits) as for the plain one."""
    from engines import engine_on

    from benchmarks.engine import decode_multiply_adds
    from chattts_service.inference.decoder_layers import KernelDepthwise

    def on_kernels(decoder) -> int:
        return sum(isinstance(m, KernelDepthwise) for m in decoder.vocos.backbone.modules())

    with engine_on(tiny_model_dir, decoder_dtype="fp32") as engine:
        decoder, hidden = engine.model.decoder, engine.model.heads.hidden_size
        kernels = engine.model.transformer.kernels

        def counted() -> int:
            return engine.scheduler.call(lambda: decode_multiply_adds(decoder, 40, hidden)).result()

        fp32 = counted()
        fp32_on_kernels = on_kernels(decoder)
        decoder.dtype = "bf16"
        decoder.hold_in_bf16()
        plain = counted()
        assert not on_kernels(decoder)
        decoder.hold_in_bf16(kernels)
        held = counted()
        held_on_kernels = on_kernels(decoder)
    assert fp32 == plain == held > 0
    if kernels is not None:
        assert fp32_on_kernels and held_on_kernels


def test_memory_benchmark_smoke(tiny_model_dir):
    result = run_benchmark(
        "benchmarks/memory.py",
        "--model-dir",
        str(tiny_model_dir),
        "--steps",
        "10",
        "--json",
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "CHATTTS_MAX_BATCH": "3", "CHATTTS_MAX_CHARS": "40"},
    )
    report = json.loads(result.stdout)
    assert report["max_batch"] == 3 and report["steps_per_request"] == 10
    assert report["peak_rss_mb"] >= report["rss_after_ready_mb"] > 0


def test_speech_benchmark_smoke(tiny_model_dir):
    result = run_benchmark(
        "benchmarks/speech.py",
        "--model-dir",
        str(tiny_model_dir),
        "--steps",
        "40",
        "--requests",
        "1",
        "--long-chars",
        "300",
        "--stream-lookahead",
        "3",
        "--json",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert data["upstream"]["first_audio_seconds"][0] > 0
    assert data["ours"]["first_audio_seconds"][0] > 0 and data["ours"]["chunks"] >= 2
    assert data["ours"]["long_text"]["segments"] >= 3
    costs = data["ours"]["fixed_costs"]
    assert set(costs["stages_seconds"]) == {
        "normalise",
        "prompt",
        "prefill_new_voice",
        "prefill",
        "encode_mp3",
        "encode_pcm",
    }
    assert all(seconds > 0 for seconds in costs["stages_seconds"].values())
    assert costs["step_seconds"] > 0 and costs["decode_first_chunk_seconds"] > 0
    # timed apart (the request, then a decode of its size alone), so on a busy host the part
    # can take longer than the whole: both are measured, neither bounds the other
    assert costs["two_step_request_seconds"] > 0 and costs["two_step_decode_seconds"] > 0
    http = data["http"]  # a real server on loopback, a streamed request over HTTP
    assert len(http["first_audio_seconds"]) == 1
    assert 0 < http["first_audio_seconds"][0] <= http["total_seconds"][0]
    assert http["audio_seconds"][0] > 0 and http["lookahead"] == 0
    from benchmarks.speech import first_audio_reason, look_ahead_reason, report

    assert "first audio over HTTP <= 0.5 s" in report(data)
    # a MISSED target says why where the steps alone put it out of reach
    slow, fast = {"first_chunk_steps": 64, "step_seconds": 0.012}, {"first_chunk_steps": 64}
    assert "0.768 s" in first_audio_reason(slow)
    assert first_audio_reason({**fast, "step_seconds": 0.005}) == ""
    assert "12.0 ms is slower than the 8.5 ms" in look_ahead_reason(slow, 52, 16)
    assert look_ahead_reason({**fast, "step_seconds": 0.006}, 52, 16) == ""
    ahead = data["http_lookahead"]  # another server, its streams started with a look-ahead
    assert ahead["lookahead"] == 3 and ahead["first_audio_seconds"][0] > 0
    assert ahead["audio_seconds"] == http["audio_seconds"]  # the same requests, as long
    from benchmarks.speech import report

    text = report(data)
    assert "first audio over HTTP <= 0.5 s" in text and "2-step request" in text
    assert "the same, look-ahead 3 " in text
    assert "a voice's first request" in text
    # the header: the CPU, its flags and what the kernels chose on it
    assert data["cpu"] in text and data["ours"]["kernel_tuning"] in text
    assert data["ours"]["kernel_tuning"].startswith(("prefetch", "no software prefetch"))


def test_cold_start_benchmark_smoke():
    result = run_benchmark(
        "benchmarks/coldstart.py", "--sizes", "tiny", "--restarts", "1", timeout=600
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CPU: ")
    first = next(line for line in lines if "first start" in line)
    assert "packed GPT written: yes" in first  # nothing was cached before it
    restart = next(line for line in lines if "restart 1" in line)
    assert float(re.search(r"ready +([\d.]+) s", restart).group(1)) > 0
    assert re.search(r"restart median [\d.]+ s \(target <= 3 s\): (ok|MISSED)$", lines[-1])


def test_tuning_benchmark_smoke(tiny_model_dir):
    def run_tuning(*extra: str) -> subprocess.CompletedProcess:
        return run_benchmark(
            "benchmarks/tuning.py",
            "--model-dir",
            str(tiny_model_dir),
            "--rounds",
            "2",
            *extra,
            timeout=300,
        )

    result = run_tuning()
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu ") and "family" in lines[0]
    from chattts_service.kernels import bindings, tuning

    # every candidate; the chosen prefetch, where it prefetches, with and without prefetching
    # at few rows; on a VNNI CPU that choice with each pairing and the chosen pairing with and
    # without four blocks at a time, then eight, and where the product may use AMX tiles the
    # chosen choice with and without them
    vnni = bindings.cpu_supports(bindings.VNNI_CPU_FLAGS)
    tiles = bindings.load("on").has_tiles
    (entry,) = [line for line in lines if line.startswith("TABLE entry: ")]
    prefetches = int(entry.split("KernelTuning(")[1].split(",")[0]) > 0
    expected = (
        len(tuning.CANDIDATES)
        + 2 * prefetches
        + (len(tuning.PAIRINGS) + 4 if vnni else 0)
        + 2 * tiles
    )
    assert sum(" rows " in line and "GB/s" in line for line in lines) == expected
    assert any(line.startswith("measure would choose: ") for line in lines)
    assert lines[-1].startswith("steal: the hypervisor took ")

    # other distances, in place of the service's candidates
    result = run_tuning("--prefetch", "16/nta,128/t0")
    timed = [line.split()[0] for line in result.stdout.splitlines() if "GB/s" in line]
    assert timed[:2] == ["16/nta/9", "128/t0/9"]
    assert len(timed) == 2 + 2 + (len(tuning.PAIRINGS) + 4 if vnni else 0) + 2 * tiles
    refused = subprocess.run(
        [sys.executable, "benchmarks/tuning.py", "--prefetch", "16/fast"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "not a prefetch candidate: '16/fast'" in refused.stderr


def test_against_benchmark_smoke(tiny_model_dir, tmp_path):
    """One library against itself: the same bits every step, a time each; a revision that
    does not exist, or a library of another ABI, is a clear error."""
    from chattts_service.kernels import bindings

    library = bindings.load("on").path
    result = run_benchmark(
        "benchmarks/against.py",
        str(library),
        "--model-dir",
        str(tiny_model_dir),
        "--rows",
        "1,3",
        "--steps",
        "4",
        "--tuning",
        "default",
        "--json",
        timeout=300,
    )
    data = json.loads(result.stdout)
    assert data["against"] == str(library)
    assert [row["rows"] for row in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert row["same_bits"] and row["largest_difference"] == 0
        assert row["ms"] > 0 and row["against_ms"] > 0 and row["ratio"] > 0

    def refused(*args: str) -> str:
        run = subprocess.run(
            [sys.executable, "benchmarks/against.py", *args, "--model-dir", str(tiny_model_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
        return run.stderr

    assert "no kernel sources at 'no-such-revision'" in refused("no-such-revision")
    foreign = tmp_path / "foreign.so"  # a library, but not of these kernels
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(foreign)],
        input="int chatts_nothing(void) { return 0; }\n",
        text=True,
        check=True,
        timeout=60,
    )
    assert "error: " in refused(str(foreign))


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git history (a checkout)")
def test_against_benchmark_builds_a_revisions_kernels(tiny_model_dir):
    """HEAD's kernel sources, fetched from git and built apart, give this checkout's bits
    when the checkout's sources are HEAD's."""
    result = run_benchmark(
        "benchmarks/against.py",
        "HEAD",
        "--model-dir",
        str(tiny_model_dir),
        "--rows",
        "2",
        "--steps",
        "3",
        "--tuning",
        "default",
        "--json",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert data["against"].startswith("HEAD (") and len(data["rows"]) == 1
    unchanged = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "chattts_service/kernels/csrc"],
        cwd=REPO,
        timeout=60,
    )
    if unchanged.returncode == 0:
        assert data["rows"][0]["same_bits"]


def test_streams_benchmark_smoke(tiny_model_dir):
    result = run_benchmark(
        "benchmarks/streams.py",
        "--model-dir",
        str(tiny_model_dir),
        "--streams",
        "1,8",
        "--steps",
        "80",
        "--rounds",
        "1",
        "--repeats",
        "2",
        "--chunks",
        "2x8",
        "--lookahead",
        "0,3",
        timeout=300,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu ") and lines[1].startswith("decoder ")
    levels = [line for line in lines if "first audio max " in line]
    assert [line.split()[0] for line in levels] == ["1", "1", "8", "8"]
    # each level with the look-ahead too, its provisional start compared with the whole answer
    assert all(" streams: " in line for line in levels[::2])
    # a stream starts exact instead where its pace could not build its start provisionally
    # (a box busy with other work): then the line names the look-ahead alone
    for line in levels[1::2]:
        assert re.search(
            r"streams \(look-ahead 3(: at most \d+ steps provisional, SNR [\d.]+ dB at least)?\)",
            line,
        ), line
    fidelity = [line for line in lines if line.startswith("a 12-step chunk decoded ")]
    assert [int(line.split()[4]) for line in fidelity] == [3, 4, 8, 12, 16, 24]
    # the tiny model's decoders read 9 steps either side: 12 steps ahead is exact, within the
    # rounding of convolutions over other widths (bit-exact on some CPUs, ~120 dB on others)
    assert fidelity[3].endswith("dB at least against its exact samples")
    assert float(fidelity[3].split("SNR ")[1].split()[0]) > 100
    assert float(fidelity[0].split("SNR ")[1].split()[0]) < 60
    for line in levels:
        match = re.search(
            r"behind max ([\d.]+) s .* ([\d.]+) chunks, ([\d.]+) audio s per wall s; "
            r"waits for the 2nd chunk max ([\d.]+) s, later max ([\d.]+) s$",
            line,
        )
        assert match and float(match[2]) >= 2 and float(match[3]) > 0, line
        # the waits are the listener's, split at the second chunk: together at most behind max
        assert (
            float(match[4]) <= float(match[1]) + 1e-3 and float(match[5]) <= float(match[1]) + 1e-3
        )
    (decode,) = [line for line in lines if line.startswith("a round of 2 x 8-step chunks")]
    assert re.search(r"stage by stage [\d.]+ ms, as windows [\d.]+ ms \([\d.]+\)$", decode)
    # what each level's last first audio was made of: its streams' prefills, the steps until
    # a first chunk could be decoded (the tiny model's decoders: 9 steps of context, and the
    # first token comes with the prefill), the decode rounds, and little else
    (waits_for,) = [line for line in lines if line.startswith("an exact first chunk waits")]
    match = re.match(
        r"an exact first chunk waits for (\d+) steps \(the decoders' (\d+) of context and its "
        r"own 12\); at the read floor \(the GPT's int8 layers read once a step, ([\d.]+) ms\) "
        r"they take ([\d.]+) s$",
        waits_for,
    )
    assert match and int(match[1]) == int(match[2]) + 12 == 21, waits_for
    assert float(match[4]) == pytest.approx(21 * float(match[3]) / 1e3, abs=0.006)
    parts = [lines[lines.index(line) + 1] for line in levels]
    for line, level, lookahead in zip(parts, levels, (0, 3, 0, 3), strict=True):
        match = re.match(
            r"    first audio ([\d.]+) s: (\d+) prefills ([\d.]+) s, (\d+) steps ([\d.]+) s"
            r"( \(at \d rows [\d.]+ ms median\))?, (\d+) decode rounds ([\d.]+) s, "
            r"the rest (-?[\d.]+) s$",
            line,
        )
        assert match, line
        streams = int(level.split()[0])
        first, prefill, step, decode, rest = (float(match[i]) for i in (1, 3, 5, 8, 9))
        assert int(match[2]) == streams and int(match[7]) >= 1
        assert int(match[4]) >= (lookahead or 9) + 12 - 1
        assert first == pytest.approx(
            float(level.split("first audio max ")[1].split()[0]), abs=0.006
        )
        # the parts do not overlap, so the rest is what they leave (rounded to the ms: the tiny
        # model's one prefill or one decode round can take under half a millisecond, 0.000 s)
        assert prefill >= 0 and step > 0 and decode >= 0 and -0.002 <= rest < first
        assert prefill + step + decode + rest == pytest.approx(first, abs=0.003)
    # the capacity target in the engine, from the 8-stream levels' worst figures
    firsts = [float(line.split("first audio max ")[1].split()[0]) for line in levels[2:]]
    behinds = [float(line.split("behind max ")[1].split()[0]) for line in levels[2:]]
    targets = lines[lines.index("targets:") + 1 : lines.index("targets:") + 3]
    match = re.match(
        r"  8 streams at once: last first audio <= 1 s +: ([\d.]+) s  (ok|MISSED)", targets[0]
    )
    assert match and float(match[1]) == max(firsts), targets
    assert match[2] == ("ok" if max(firsts) <= 1 else "MISSED")
    from benchmarks.loadtest import TOLERANCE_SECONDS

    match = re.match(
        rf"  8 streams at once: each within {TOLERANCE_SECONDS:g} s of playback +: ([\d.]+) s "
        r"behind at most  (ok|MISSED)$",
        targets[1],
    )
    assert match and float(match[1]) == pytest.approx(max(behinds), abs=1e-3), targets
    assert match[2] == ("ok" if float(match[1]) <= TOLERANCE_SECONDS else "MISSED")


def test_streams_target_says_what_a_missed_first_audio_was_made_of():
    sys.path.insert(0, str(REPO))
    from benchmarks.streams import target_lines

    parts = {"step_seconds": 0.83, "prefill_seconds": 0.38, "decode_seconds": 0.22}
    level = {"streams": 8, "first_audio_max": 1.45, "behind_max": 0.02, "first_audio_parts": parts}
    fast = {**level, "first_audio_max": 0.9, "behind_max": 0.35}
    data = {"read_floor_ms": 6.5, "first_chunk_steps": 64}
    lines = target_lines([fast, level], data)
    assert lines[0] == "targets:"
    # the worst first audio of the levels, and why: 64 steps at the read floor take 0.42 s
    assert lines[1].endswith(
        ": 1.45 s  MISSED (its steps 0.83 s, 0.42 s at the read floor; its prefills 0.38 s; "
        "its decode rounds 0.22 s)"
    )
    assert lines[2].endswith(": 0.350 s behind at most  MISSED")
    held = target_lines([fast | {"behind_max": 0.05}], data)
    assert held[1].endswith(": 0.90 s  ok") and held[2].endswith(": 0.050 s behind at most  ok")


def test_attention_benchmark_smoke():
    result = run_benchmark(
        "benchmarks/attention.py",
        "--shapes",
        "1x10,3x40",
        "--reserve",
        "64",
        "--rounds",
        "2",
        timeout=300,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu ") and lines[1].startswith("bf16 KV cache, 20 layers")
    shapes = [line for line in lines if " positions: attention " in line]
    assert [line.split()[:4] for line in shapes] == [
        ["1", "rows", "x", "10"],
        ["3", "rows", "x", "40"],
    ]
    for line in shapes:
        assert re.search(
            r"attention [\d.]+ ms \([\d.]+ GB/s\), less the calls' own [\d.]+ ms [\d.]+ ms "
            r"\([\d.]+ GB/s\); reading as many",
            line,
        ), line
    assert re.fullmatch(
        r"steal: the hypervisor took [\d.]+% of this machine's CPU time.*", lines[-1]
    )


def test_steal_is_read_from_the_kernels_cpu_line(tmp_path):
    """/proc/stat's aggregate line: user, nice, system, idle, iowait, irq, softirq, steal,
    then guest time (already inside user time, so not counted again)."""
    from chattts_service.runtime.cpu import StealMeter, describe_steal, host_cpu_ticks

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 10 0 5 30 7 0\ncpu0 50 2 25 400 5 0 2 15 3 0\n")
    assert host_cpu_ticks(str(stat)) == (1000, 30)
    meter = StealMeter(str(stat))
    assert meter.share() is None  # no tick has passed
    stat.write_text("cpu  200 5 60 900 10 0 5 70 9 0\n")
    assert meter.share() == 40 / 250
    assert "16.0%" in describe_steal(meter.share()) and "side by side" in describe_steal(0.16)
    assert "side by side" not in describe_steal(0.01)
    stat.write_text("cpu  100 5 50 800 10 0 5\n")  # a kernel without the steal field
    assert host_cpu_ticks(str(stat)) is None and StealMeter(str(stat)).share() is None
    assert host_cpu_ticks(str(tmp_path / "absent")) is None
    assert describe_steal(None).startswith("steal: not measured")
    # this machine's own
    real = StealMeter()
    assert host_cpu_ticks() is not None
    time.sleep(0.2)
    assert 0 <= real.share() <= 1


def test_home_assistant_benchmark_smoke(tiny_endless_model_dir):
    """benchmarks/home_assistant.py against a real server on the tiny model: both first audios
    measured, and the streamed answer's five sentences spoken."""
    result = run_benchmark(
        "benchmarks/home_assistant.py",
        "--model-dir",
        str(tiny_endless_model_dir),
        "--rounds",
        "2",
        "--max-new-tokens",
        "20",
        "--json",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert len(data["wyoming_first_audio"]) == len(data["http_first_audio"]) == 2
    assert all(
        0 < seconds < 60 for seconds in data["wyoming_first_audio"] + data["http_first_audio"]
    )
    (streamed,) = data["streamed"]
    assert streamed["sentences"] == 5 and streamed["audio_seconds"] > 0
    assert 0 <= streamed["first_audio_after_first_sentence"] < 60


def test_scripts_benchmark_smoke(tiny_endless_model_dir):
    """benchmarks/scripts.py against a real server on the tiny model: the parsing costs, and
    the dialogue made all three ways with the same audio length."""
    result = run_benchmark(
        "benchmarks/scripts.py",
        "--model-dir",
        str(tiny_endless_model_dir),
        "--rounds",
        "1",
        "--max-new-tokens",
        "20",
        "--json",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert set(data["parse_seconds"]) == {"plain", "ssml", "ssml_say_as"}
    assert all(0 < seconds < 1 for seconds in data["parse_seconds"].values())
    assert set(data["wall_seconds"]) == {"dialogue", "one_by_one", "at_once"}
    audio = data["audio_seconds"]
    # every way speaks the same turns with the same seed: the same audio, whoever schedules it
    assert audio["dialogue"] > 0
    assert audio["dialogue"] == pytest.approx(audio["one_by_one"], abs=0.002)
    assert audio["at_once"] == pytest.approx(audio["dialogue"], abs=0.002)
    assert 0 < data["streamed_dialogue_first_audio"][0] < 60


def test_arrivals_benchmark_smoke(tiny_model_dir):
    """benchmarks/arrivals.py against a real server on the tiny model: the stream's first audio
    alone and as the long texts arrive, every round, and the texts answered."""
    result = run_benchmark(
        "benchmarks/arrivals.py",
        "--model-dir",
        str(tiny_model_dir),
        "--rounds",
        "2",
        "--json",
        timeout=600,
    )
    data = json.loads(result.stdout)
    assert len(data["first_audio_alone"]) == len(data["first_audio_with_documents"]) == 2
    assert all(0 < s < 60 for s in data["first_audio_alone"] + data["first_audio_with_documents"])
    assert data["ratio"] > 0 and data["document_seconds_median"] > 0
