"""The public API is pinned, and importing qlitert pulls in no TensorFlow."""

import subprocess
import sys

import qlitert


def test_public_api_is_pinned():
    assert set(qlitert.__all__) == {
        "Annotated",
        "Calibration",
        "ExportError",
        "Int16Choice",
        "Layer",
        "LayerReport",
        "LiteRTModel",
        "ModelReport",
        "ModuleSensitivity",
        "Rule",
        "SiteKey",
        "UnsupportedOpError",
        "__version__",
        "annotate",
        "calibrate",
        "check_agreement",
        "check_kernels",
        "check_path",
        "choose_int16",
        "compare_layers",
        "converter",
        "dynamic_range",
        "export",
        "export_dynamic_range",
        "inspect",
        "qat",
        "qdq",
        "rules",
        "save",
        "sensitivity",
    }


def test_importing_qlitert_imports_neither_tensorflow_nor_the_converter():
    code = (
        "import sys, qlitert; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'tensorflow', 'litert_converter', 'ai_edge_litert', 'qtorchlike'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
