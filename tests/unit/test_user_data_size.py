"""EC2 takes at most 16 KiB of user-data (gzip-compressed here): the largest cluster the stack accepts
keeps a quarter of it free on every host, measured on the real rendered user-data of the mocked
program; and what user-data leaves out to get there (comments) changes nothing bash or Python runs."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
import yaml

from bootstrap import node_layout, shipped_form, user_data
from cluster import hostpaths
from cluster.stack_config import MAX_GPU_NODES
from infra.config import PlanError
from tests.support.pulumi_mocks import run_program, stack_config, user_data_of, user_data_size
from tests.unit.test_bootstrap_render import FACTS
from tests.unit.test_infra_program import _instances

HEADROOM_LIMIT = user_data.MAX_USER_DATA_BYTES * 3 // 4  # 12 KiB: at least 25% of EC2's 16 KiB free


def test_the_largest_accepted_cluster_fits_with_a_quarter_to_spare():
    """The biggest user-data: the controller's at the most GPU nodes (it lists them all), and a GPU
    node's on the spot market (the interruption watcher) with p5.48xlarge's 32 EFA cards. A GPU
    node's own depends on no other node (bootstrap/user_data.py user_data), so two nodes show it."""
    largest = run_program(stack_config(gpuNodeCount=MAX_GPU_NODES, subnetCidr="10.0.0.0/24", gpuMarket="spot"))
    widest = run_program(stack_config(gpuInstanceType="p5.48xlarge", gpuMarket="spot"))
    sizes = {}
    for run in (largest, widest):
        controller, gpus = _instances(run)
        files = {f["path"] for f in yaml.safe_load(user_data_of(gpus[-1]))["write_files"]}
        assert node_layout.SPOT_WATCH_PATH in files
        sizes.update({f"{len(gpus)}x{i.inputs['instanceType']}:{i.name}": user_data_size(i)
                      for i in controller + gpus})
    assert len(_instances(largest)[1]) == MAX_GPU_NODES
    assert max(sizes.values()) <= HEADROOM_LIMIT, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    # One more node is refused, naming the setting and the fix, before anything is declared.
    with pytest.raises(PlanError) as err:
        run_program(stack_config(gpuNodeCount=MAX_GPU_NODES + 1, subnetCidr="10.0.0.0/24"))
    assert str(err.value).startswith(f"slurm-gpu:gpuNodeCount is {MAX_GPU_NODES + 1}; a stack has at most")
    assert f"`pulumi config set slurm-gpu:gpuNodeCount {MAX_GPU_NODES}`" in str(err.value)


def _bash_parse(script: str) -> str:
    """The commands bash reads from a script: its text as a function body, printed back by
    `declare -f` (bash's own parser; comments are gone, here-documents kept)."""
    res = subprocess.run(["bash", "-c", 'eval "f() {\n$1\n}" && declare -f f', "parse", script],
                         capture_output=True, text=True, check=True)
    return res.stdout


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
@pytest.mark.parametrize("name", ["l4x2", "h100x3", "single"])
@pytest.mark.parametrize("spot", [False, True])
def test_shipped_shell_scripts_parse_to_the_same_commands(name, spot):
    facts = replace(FACTS[name], spot=spot)
    scripts = {f"{role}:{path}": text for role in node_layout.ROLES
               for path, text in user_data.bootstrap_files(facts, role, None if role == "controller" else
                                                        facts.gpu_nodes[0].name).items()
               if text.startswith("#!/bin/bash\n")}
    assert any(k.endswith(hostpaths.BOOTSTRAP_PATH) for k in scripts)
    for where, text in scripts.items():
        shipped = shipped_form.shipped_shell(text)
        assert shipped.startswith("#!/bin/bash\n") and len(shipped) < len(text), where
        assert _bash_parse(shipped) == _bash_parse(text), where


# ------------------------------------------------------------ what shipped_shell must not strip or join

def test_a_comment_line_after_a_continuation_fails_the_render_rather_than_join_two_commands():
    """`echo a \\` then `  # note` then `echo b`: bash ends the continued command at the comment, so
    dropping the comment line would make `echo a echo b`."""
    script = "#!/bin/bash\necho a \\\n  # note\necho b\n"
    with pytest.raises(shipped_form.UnsafeShell, match="continuation"):
        shipped_form.shipped_shell(script)
    # A comment line after a line ending in an escaped backslash is no continuation.
    assert shipped_form.shipped_shell("#!/bin/bash\necho a\\\\\n# note\necho b\n") == "#!/bin/bash\necho a\\\\\necho b\n"


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
@pytest.mark.parametrize("start", ["<<'EOF-X'", '<<"EOF.X"', "<<-EOF-X", "<< EOF-X"])
def test_any_here_document_delimiter_keeps_its_body(start):
    end = "\tEOF-X" if start.startswith("<<-") else ("EOF.X" if "." in start else "EOF-X")
    script = f"#!/bin/bash\ncat > /tmp/x {start}\n# data, not a comment\n{end}\n# a comment\necho done\n"
    shipped = shipped_form.shipped_shell(script)
    assert "# data, not a comment" in shipped and "# a comment" not in shipped
    assert _bash_parse(shipped) == _bash_parse(script)


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
def test_two_here_documents_on_a_line_and_a_multi_line_string_keep_their_data():
    script = ("#!/bin/bash\npaste /dev/fd/3 3<<A - <<'B'\n# a\nA\n# b\nB\n"
              "msg='one\n# two'\n# gone\necho \"$msg\"\n")
    shipped = shipped_form.shipped_shell(script)
    assert shipped == script.replace("# gone\n", "")
    assert _bash_parse(shipped) == _bash_parse(script)


@pytest.mark.parametrize("script,why", [
    ("#!/bin/bash\ncat <<\necho\n", "cannot parse"),
    ("#!/bin/bash\ncat <<EOF\n# body\n", "never ends"),
    ("#!/bin/bash\necho 'open\n# x\n", "never closes"),
])
def test_what_shipped_shell_cannot_follow_fails_the_render(script, why):
    with pytest.raises(shipped_form.UnsafeShell, match=why):
        shipped_form.shipped_shell(script)


def test_the_power_program_ships_as_the_same_code_without_its_comments():
    """The controller's power program goes into user-data without comments and docstrings (shipped_python):
    the same AST, less text; fab's copy (`fab update-nodes`) keeps them."""
    import ast

    from tests.unit.test_power_save import EC2, REGION, STACK
    from tests.unit.test_spot_watch import _code

    facts = replace(FACTS["l4x2"], power_save=EC2, region=REGION, stack=STACK)
    source = user_data.bootstrap_files(facts, "controller")[node_layout.POWER_PATH]
    files = yaml.safe_load(user_data.user_data(facts, "controller"))["write_files"]
    shipped = next(f["content"] for f in files if f["path"] == node_layout.POWER_PATH)
    assert shipped.splitlines()[0] == source.splitlines()[0]  # the interpreter line
    assert len(shipped) < 0.9 * len(source)
    assert _code(ast.parse(shipped)) == _code(ast.parse(source))
