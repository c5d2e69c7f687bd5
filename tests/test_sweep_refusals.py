"""A sweep that cannot run is refused with one message before any engine starts: its input (a
JSON lines file pyarrow cannot type, no prompt at all, a path that does not exist), its output
(one that cannot be made, a folder holding another sweep), its config (not YAML, a program that
would do nothing, generation settings vLLM cannot take); an output inside an input folder,
whose files are not read as prompts; what a failed sweep's status names; and a folder `open_sweep` cannot read as a sweep. One local Ray for the module, which each sweep joins (as
``ray job submit`` has it do)."""

from __future__ import annotations

import json
import re
import signal
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import interlace
from interlace.cluster.config import SweepConfig
from interlace.cluster.sweep.runner import run_sweep
from test_sweep import CLUSTER, write_config, write_jsonl

OPS = {"ops": [{"op": "save", "point": "logits"}]}


@pytest.fixture(scope="module")
def local_ray():
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=200 << 20)
    yield
    ray.shutdown()


def test_a_json_lines_file_mixing_text_and_token_prompts_is_refused_naming_the_file(local_ray, tmp_path):
    """pyarrow cannot type such a column, Ray Data then read the file as one JSON value, and the
    sweep failed with "RayTaskError(JSONDecodeError): ray::ReadArrowJSON->SplitBlocks(4)()"."""
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a text"}, {"prompt": [1, 5, 7]}])
    fields = dict(input={"paths": ["prompts.jsonl"]}, output="out", intervention=OPS)
    with pytest.raises(ValueError, match=r"prompts.jsonl'\] could not be read as json: JSONDecodeError: .*"
                                         r"every row's prompt must be of one kind in a file"):
        run_sweep(SweepConfig.load(write_config(tmp_path, "mixed", **fields)))


@pytest.mark.parametrize("case", ["empty JSON lines", "Parquet of no rows", "folder of no files"])
def test_an_input_without_prompts_is_refused_naming_it(local_ray, tmp_path, case):
    """An empty JSON lines file failed with "ArrowInvalid: Must pass at least one table" and a hint
    about mixed prompts; a Parquet file of no rows "completed" a sweep of nothing."""
    if case == "empty JSON lines":
        (tmp_path / "prompts.jsonl").write_text("")
        source, why = {"paths": ["prompts.jsonl"]}, r"prompts.jsonl'\] holds no rows; a sweep needs at least one prompt"
    elif case == "Parquet of no rows":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "prompts.parquet")
        source, why = {"paths": ["prompts.parquet"]}, r"prompts.parquet'\] holds no rows"
    else:
        (tmp_path / "prompts").mkdir()
        source, why = {"paths": ["prompts"], "format": "json"}, r"prompts'\] holds no files"
    config = SweepConfig.load(write_config(tmp_path, "empty", input=source, output="out", intervention=OPS))
    with pytest.raises(ValueError, match=why):
        run_sweep(config)
    assert not list((tmp_path / "out").glob("shard-*"))


def test_a_missing_input_or_an_output_that_cannot_be_made_is_one_line_from_the_command(local_ray, tmp_path, capsys):
    """`interlace sweep` answered both with a traceback (FileNotFoundError, NotADirectoryError)."""
    from interlace.cli import main

    (tmp_path / "a-file").write_text("")
    handler = signal.getsignal(signal.SIGTERM)  # main() takes SIGTERM over, as the command does
    try:
        for name, fields, message in (
                ("missing", dict(input={"paths": ["nope.jsonl"]}, output="out"), "input path .*nope.jsonl does not exist"),
                ("unmakeable", dict(input={"paths": ["nope.jsonl"]}, output="a-file/out"), "Not a directory")):
            config = write_config(tmp_path, name, cluster={**CLUSTER, "replicas": 1}, generation={"max_tokens": 2}, **fields)
            assert main(["sweep", str(config)]) == 2
            err = capsys.readouterr().err
            assert re.search(f"^interlace sweep: .*{message}", err, re.M) and "Traceback" not in err, err
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_a_config_that_is_not_valid_yaml_is_refused_naming_its_line(tmp_path, capsys):
    """`interlace sweep` answered a YAML typo with a traceback (yaml's error is no ValueError)."""
    from interlace.cli import main

    bad = tmp_path / "typo.yaml"
    bad.write_text("cluster: tiny-llama-2\ninput: {paths: [prompts.jsonl]\n")
    handler = signal.getsignal(signal.SIGTERM)  # main() takes SIGTERM over, as the command does
    try:
        for command in ("sweep", "serve"):
            assert main([command, str(bad)]) == 2
            assert "not valid YAML" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, handler)
    with pytest.raises(ValueError, match=f'(?s)not valid YAML: .*in "{bad}", line 2'):
        interlace.Model(bad)


def test_a_folder_holding_another_sweep_is_refused_before_anything_starts(tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    fields = dict(input={"paths": ["prompts.jsonl"]}, output="out", shard_size=4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"identity": "another sweep"}))
    with pytest.raises(ValueError, match="holds another sweep"):
        run_sweep(SweepConfig.load(write_config(tmp_path, "mine", **fields)))


def test_a_program_that_would_do_nothing_or_cannot_take_m_is_refused_before_anything_starts(tmp_path):
    import ray

    ray_was_up = ray.is_initialized()  # (this module's other tests may have left their cluster up)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    (tmp_path / "odd_programs.py").write_text(textwrap.dedent("""
        def generator(m):
            m.save("r", m.layers[1].resid)
            yield

        def two(m, layer):
            m.save("r", m.layers[layer].resid)
    """))
    for name, why in [("generator", "generator is a generator function"), ("two", r"two\(m, layer\) cannot be called")]:
        fields = dict(input={"paths": ["prompts.jsonl"]}, output=f"out-{name}", intervention={"program": f"odd_programs:{name}"})
        with pytest.raises(ValueError, match=f"intervention.program 'odd_programs:{name}': program {why}"):
            run_sweep(SweepConfig.load(write_config(tmp_path, name, **fields)))
    # Program settings with no program: the ops ran at every step, steps and all ignored.
    for setting, why in [({"steps": [0]}, r"steps=\[0\] selects the steps a program runs at"), ({"batched": True}, "batched marks")]:
        intervention = {"ops": [{"op": "save", "point": "layers.1.resid"}], **setting}
        fields = dict(input={"paths": ["prompts.jsonl"]}, output="out-ops", intervention=intervention)
        with pytest.raises(ValueError, match=f"{why}.*this invoke has no program"):
            SweepConfig.load(write_config(tmp_path, "ops", **fields))
    assert ray.is_initialized() == ray_was_up  # refused before the sweep joins or starts a Ray cluster


def test_generation_settings_vllm_cannot_take_are_refused_before_anything_starts(tmp_path):
    """A sampling field of the wrong type (YAML reads ``seed: "1"`` and ``bad_words: [5]`` as
    written) failed in every replica's engine core, where it first hung the engine (fixed in
    cluster/assembly.py), then failed each shard under a Ray wrapper that named no cause."""
    import ray

    from interlace.cluster.sweep.prompts import first_line as _first_line

    ray_was_up = ray.is_initialized()
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    for sampling, why in [({"bad_words": [5]}, r"sampling setting bad_words\[0\]: Expected `str`, got `int`"),
                          ({"logit_bias": {"x": 1.0}}, "sampling setting logit_bias")]:
        fields = dict(input={"paths": ["prompts.jsonl"]}, output="out", generation={"sampling": sampling})
        with pytest.raises(ValueError, match=f"the sweep's generation settings: {why}"):
            run_sweep(SweepConfig.load(write_config(tmp_path, "bad", **fields)))
    # a named field set again in sampling failed with "dict() got multiple values for keyword argument"
    fields = dict(input={"paths": ["prompts.jsonl"]}, output="out", generation={"seed": 1, "sampling": {"seed": 2}})
    with pytest.raises(ValueError, match=r"generation.sampling sets \['seed'\], which are generation's own fields; set generation.seed"):
        SweepConfig.load(write_config(tmp_path, "twice", **fields))
    assert ray.is_initialized() == ray_was_up
    # A failure raised through Ray's wrappers: the status names the cause, not the actor
    try:
        try:
            raise TypeError("sampling setting seed: Expected `int | null`")
        except TypeError as cause:
            raise RuntimeError("ray::MapWorker(MapBatches(ShardRunner)).submit() (pid=1)\nTraceback...") from cause
    except RuntimeError as wrapped:
        assert _first_line(wrapped) == "TypeError: sampling setting seed: Expected `int | null`"


def test_the_same_sweep_started_again_while_it_runs_is_refused_and_the_first_finishes(local_ray, tmp_path):
    """The second run ran every shard again, and the two runs' files of one shard could interleave."""
    import threading
    import time

    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i} is"} for i in range(6)])
    config = SweepConfig.load(write_config(tmp_path, "once", cluster={"model": "tiny-llama", "replicas": 1, "cpu_cores": [[0]]},
                                           input={"paths": ["prompts.jsonl"]}, output="out", shard_size=2,
                                           intervention=OPS, generation={"max_tokens": 2}))
    first: dict = {}
    runner = threading.Thread(target=lambda: first.update(manifest=run_sweep(config, echo=lambda *_: None)), daemon=True)
    runner.start()
    manifest = tmp_path / "out" / "manifest.json"
    deadline = time.monotonic() + 120
    while not (manifest.is_file() and json.loads(manifest.read_text())["status"] == "running"):
        assert runner.is_alive() and time.monotonic() < deadline, "the first run never got going"
        time.sleep(0.2)
    with pytest.raises(ValueError, match=r"out is being written by another interlace sweep \(pid \d+ on .*, since .*\); "
                                         "let it end or stop it, then run this command again"):
        run_sweep(config)
    runner.join(timeout=300)
    assert not runner.is_alive() and first["manifest"]["status"] == "complete"
    assert sorted(int(k) for k in first["manifest"]["shards"]) == [0, 1, 2]
    assert json.loads(manifest.read_text())["status"] == "complete"  # the refused run wrote nothing
    assert sorted(interlace.open_sweep(tmp_path / "out").to_pandas()["prompt_id"]) == list(range(6))
    run_sweep(config, echo=lambda *_: None)  # the lock went with the first run: a rerun resumes (nothing to do)


def test_more_replicas_than_a_local_ray_holds_are_refused_with_the_arithmetic(local_ray, tmp_path):
    """The actor pool waited for every replica (up to 15 minutes), printing nothing."""
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    config = SweepConfig.load(write_config(tmp_path, "many", cluster={"model": "tiny-llama", "replicas": 2},
                                           input={"paths": ["prompts.jsonl"]}, output="out", intervention=OPS))
    with pytest.raises(ValueError, match=r"2 replicas of 'tiny-llama' need \{CPU: 1\} each on one node, .* hold 1 "
                                         r"such replica\(s\)\. Lower `replicas`"):
        run_sweep(config)


def test_a_program_module_that_fails_to_import_or_a_tensor_file_of_another_kind_is_refused(tmp_path):
    """Each ended `interlace sweep` with a traceback: the module's SyntaxError or its own error at
    import, and safetensors' "header too large" (naming no file) for a torch.save file."""
    import torch

    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a"}])
    (tmp_path / "typo.py").write_text('def f(m)\n    m.save("x", m.layers[1].resid)\n')
    (tmp_path / "fails.py").write_text("import torch\nSCALE = 1 / 0\n\ndef f(m):\n    pass\n")
    torch.save({"steer": torch.ones(128)}, tmp_path / "steer.pt")
    for name, intervention, why in [
            ("typo", {"program": "typo:f"}, r"'typo:f': importing 'typo' failed: SyntaxError: expected ':' \(typo.py, line 1\)"),
            ("fails", {"program": "fails:f"}, r"'fails:f': importing 'fails' failed: ZeroDivisionError: division by zero "
                                              r"\(at fails.py, line 2\)"),
            ("pt", {"ops": [{"op": "add", "point": "layers.1.resid", "value": {"file": "steer.pt", "name": "steer"}}]},
             r"steer.pt is not a .safetensors file \(.*header too large\); write it with safetensors.torch.save_file")]:
        config = SweepConfig.load(write_config(tmp_path, name, input={"paths": ["prompts.jsonl"]}, output=f"out-{name}",
                                               intervention=intervention))
        with pytest.raises(ValueError, match=why):
            run_sweep(config)


def test_open_sweep_refuses_what_is_not_a_sweep_naming_it(tmp_path):
    """A manifest that is not JSON failed with json's bare "Expecting property name" (no file
    named), and open_sweep(None) with "None has no manifest.json"."""
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "manifest.json").write_text('{"status": "runn')
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"name": "some other tool"}')
    for folder in ("torn", "other"):
        with pytest.raises(ValueError, match=rf"{folder}/manifest.json is not a sweep's manifest \(\w+"):
            interlace.open_sweep(tmp_path / folder)
    with pytest.raises(FileNotFoundError, match="has no manifest.json; is it a sweep's output folder"):
        interlace.open_sweep(tmp_path)
    with pytest.raises(TypeError, match="a folder or a URL .* not NoneType"):
        interlace.open_sweep(None)


def test_an_output_inside_an_input_folder_is_not_read_as_input(local_ray, tmp_path):
    """A rerun read the first run's files in ``data/out`` as prompts and was refused as a sweep of
    changed input ("holds 3 finished shards made from other prompts")."""
    from interlace.cluster.config import SweepInput
    from interlace.cluster.sweep.prompts import read_prompts

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    (data / "out").mkdir()  # what a first run into data/out leaves there
    write_jsonl(data / "out" / "shard-00000.json", [{"shard": 0, "prompts": 3}])
    (data / "out" / "manifest.json").write_text(json.dumps({"identity": "x", "shards": {}}))
    rows = read_prompts(SweepInput(paths=[str(data)], format="json"), data / "out")
    assert [r.prompt for r in rows] == ["p0", "p1", "p2"] and not any(r.problem for r in rows)


def test_a_failed_sweeps_status_names_the_error_inside_ray_datas_wrapper(local_ray):
    """A failed sweep's status read "UserCodeException: UDF failed to process a data block.": Ray
    Data passes the runner's own error on only as the remote traceback's text."""
    import ray.data

    from interlace.cluster.sweep.prompts import first_line

    class FailingRunner:  # a UDF that fails as a shard runner's bug would (local: pickled by value)
        def __call__(self, batch):
            raise KeyError("a field the runner expected")

    with pytest.raises(Exception) as failed:
        list(ray.data.from_items([{"a": 1}]).map_batches(
            FailingRunner, batch_size=1, compute=ray.data.ActorPoolStrategy(size=1)).iter_rows())
    assert type(failed.value.cause).__name__ == "UserCodeException"  # Ray Data's wrapper, as a sweep meets it
    assert first_line(failed.value) == "KeyError: 'a field the runner expected'"
