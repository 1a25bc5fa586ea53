from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="lightllm",
    version="0.1.0",
    description="A LightLLM-shaped LLM serving engine with ASD approximate MTP verification",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    package_data={"lightllm": ["drafts/*/*/*"]},
    python_requires=">=3.10",
    install_requires=requirements,
)
