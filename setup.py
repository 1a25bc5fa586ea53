from setuptools import find_packages, setup


def read_requirements(path: str) -> list[str]:
    """The requirement lines of ``path``, comments dropped."""
    with open(path) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return [line for line in lines if line]


setup(
    name="lightllm",
    version="0.1.0",
    description="A LightLLM-shaped LLM serving engine with ASD approximate MTP verification",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    package_data={"lightllm": ["drafts/*/*/*"]},
    python_requires=">=3.10",
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        "tools": read_requirements("requirements-tools.txt"),
        "dev": read_requirements("requirements-dev.txt"),
    },
)
