"""``hgraph show --dot/--svg`` writes files that Graphviz tools parse, holding the rank's program."""

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pydot
import pytest
import torch

import hgraph
from hgraph.cli.demo import tiny_model


def test_show_writes_dot_and_svg_that_parse(tmp_path):
    dot, svg = tmp_path / "rank1.dot", tmp_path / "rank1.svg"
    has_dot = shutil.which("dot") is not None
    args = [sys.executable, "-m", "hgraph", "show", "--strategy", "tp2", "--rank", "1", "--dot", str(dot)]
    out = subprocess.run(args + (["--svg", str(svg)] if has_dot else []), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (graph,) = pydot.graph_from_dot_file(str(dot))
    nodes = {n.get_name().strip('"') for n in graph.get_nodes()} - {"node"}
    edges = {(e.get_source().strip('"'), e.get_destination().strip('"')) for e in graph.get_edges()}
    compiled = hgraph.compile(tiny_model(), ["tp2"], example_inputs=torch.randint(0, 256, (1, 16)))
    gm = compiled.program(0, 1).stage_graph.gm
    assert nodes == {n.name for n in gm.graph.nodes}
    assert edges == {(a.name, n.name) for n in gm.graph.nodes for a in n.all_input_nodes}
    comm = {n.name for n in gm.graph.nodes if n.meta.get("hgraph_comm")}
    assert comm, "a tp2 program communicates"
    filled = {n.get_name().strip('"') for n in graph.get_nodes() if n.get("style") == "filled"}
    assert filled == comm
    if not has_dot:
        pytest.skip("Graphviz 'dot' is not installed (apt-get install graphviz); the SVG part needs it")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    titles = {t.text for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "node"
              for t in g.iter("{http://www.w3.org/2000/svg}title")}
    assert titles == nodes
