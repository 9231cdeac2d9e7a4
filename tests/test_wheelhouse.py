"""scripts/wheelhouse.py: what an air-gapped GPU node with its own torch still needs, from pip's resolution (a
hand-made install report here: nothing is downloaded) and the node's `pip freeze`."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import wheelhouse  # noqa: E402


def item(name, version, *requires):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


REPORT = {
    "environment": {"python_version": "3.12", "python_full_version": "3.12.1", "sys_platform": "linux"},
    "install": [
        item("hydra-core", "1.3.8", "omegaconf<2.4,>=2.2", "antlr4-python3-runtime==4.9.*", "packaging"),
        item("omegaconf", "2.3.1", "antlr4-python3-runtime==4.9.*", "PyYAML>=5.1.0"),
        item("antlr4-python3-runtime", "4.9.3"),
        item("packaging", "25.0"),
        item("PyYAML", "6.0.3"),
        item("timm", "1.0.31", "torch", "torchvision", "pyyaml", "huggingface_hub", "safetensors"),
        item("safetensors", "0.7.0"),
        item("huggingface-hub", "1.1.0", "filelock", "fsspec>=2023.5.0", "pyyaml>=5.1", "requests", "tqdm>=4.42.1"),
        item("requests", "2.33.0", "urllib3<3,>=1.21.1", "idna<4,>=2.5", "certifi>=2017.4.17"),
        item("urllib3", "2.6.0"),
        item("idna", "3.11"),
        item("certifi", "2026.1.4"),
        item("tqdm", "4.70.1", 'colorama; platform_system == "Windows"'),
        item("wandb", "0.31.0", "pydantic>=2", "typing-extensions<5,>=4.14; python_version < '3.13'"),
        item("pydantic", "2.12.0", "typing-extensions>=4.12"),
        item("typing-extensions", "4.16.0"),
        item("mlflow-skinny", "3.18.0", "opentelemetry-sdk[otlp]>=1.9"),
        item("opentelemetry-sdk", "1.38.0", 'opentelemetry-exporter-otlp>=1.0; extra == "otlp"'),
        item("opentelemetry-exporter-otlp", "1.38.0"),
        item("scikit-learn", "1.9.1", "numpy>=1.22", "scipy>=1.8"),
        item("numpy", "2.5.5"),
        item("scipy", "1.18.1", "numpy<2.8,>=1.25.2"),
        # torch's and torchvision's own: only they need these
        item(
            "torch",
            "2.14.1",
            "filelock",
            "typing-extensions>=4.10.0",
            "sympy>=1.13.3",
            "networkx>=2.5.1",
            "jinja2",
            "fsspec>=0.8.5",
            'nvidia-cublas==13.1.0.3; platform_system == "Linux"',
            'triton==3.6.0; platform_system == "Linux"',
        ),
        item("torchvision", "0.29.1", "numpy", "torch==2.14.1", "pillow!=8.3.*,>=5.3.0"),
        item("sympy", "1.14.0", "mpmath<1.4,>=1.1.0"),
        item("mpmath", "1.3.0"),
        item("networkx", "3.5"),
        item("jinja2", "3.1.6", "MarkupSafe>=2.0"),
        item("MarkupSafe", "3.0.3"),
        item("nvidia-cublas", "13.1.0.3"),
        item("triton", "3.6.0"),
        item("pillow", "12.0.0"),
        item("filelock", "3.20.0"),
        item("fsspec", "2025.10.0"),
    ],
}
ROOTS = [
    "hydra-core>=1.3.8,<1.4",
    "timm>=1.0.31,<1.1",
    "tqdm>=4.70.1",
    "wandb>=0.31.0",
    "mlflow-skinny>=3.18,<4",
    "scikit-learn>=1.9.1",
]
TORCH_ONLY = {"torch", "torchvision", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "nvidia-cublas", "triton"}


def names(pins):
    return {wheelhouse.canonical(pin.partition("==")[0]) for pin in pins}


def test_torch_and_what_only_torch_needs_are_left_out_what_others_share_is_kept():
    pins, why = wheelhouse.select(REPORT, ROOTS)
    assert set(why) == TORCH_ONLY | {"pillow"}  # pillow: torchvision's alone here
    assert names(pins) == {wheelhouse.canonical(i["metadata"]["name"]) for i in REPORT["install"]} - set(why)
    assert {"filelock", "fsspec", "typing-extensions", "numpy"} <= names(pins)  # torch's too, but not only torch's
    assert "opentelemetry-exporter-otlp" in names(pins)  # reached through an extra ([otlp])
    assert "hydra-core==1.3.8" in pins and "PyYAML==6.0.3" in pins  # the resolved versions, the index's spelling


def test_the_nodes_packages_at_satisfying_versions_are_left_out_with_what_only_they_need():
    freeze = wheelhouse.parse_freeze(
        "# a node's pip freeze\nPyYAML==6.0.2\nrequests==2.32.3\npackaging==24.2\ntqdm==4.67.1\n"
        "typing_extensions==4.12.2\nnumpy==2.1.3\ntorch==2.11.0+cu130\n-e git+https://x/y.git#egg=z\n"
        "attrs @ file:///tmp/attrs.whl\n"
    )
    assert freeze["pyyaml"] == "6.0.2" and freeze["typing-extensions"] == "4.12.2" and "attrs" not in freeze
    pins, why = wheelhouse.select(REPORT, ROOTS, freeze)
    kept = names(pins)
    assert {"pyyaml", "requests", "packaging", "numpy"} & kept == set()
    assert why["requests"] == "on the node (2.32.3)"
    # what only requests needed is the node's business
    assert {"urllib3", "idna", "certifi"} & kept == set() and why["idna"] == "only needed by a package on the node"
    assert "tqdm" in kept  # 4.67.1 is under trainkit's floor (4.70.1)
    assert "typing-extensions" in kept  # wandb wants >=4.14 on Python < 3.13
    # the same node on Python 3.13: wandb's marker does not apply, pydantic's >=4.12 is met by 4.12.2
    pins313, _ = wheelhouse.select(REPORT, ROOTS, freeze, python_version="3.13")
    assert "typing-extensions" not in names(pins313)


def test_the_roots_are_pyprojects_dependencies_but_torch_and_torchvision():
    roots = {
        wheelhouse.canonical(r.split(">")[0].split("=")[0].split("<")[0])
        for r in wheelhouse.roots(ROOT / "pyproject.toml")
    }
    assert "hydra-core" in roots and "optuna" in roots and "wandb" in roots
    assert not roots & {"torch", "torchvision"}
