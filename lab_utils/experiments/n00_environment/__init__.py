"""Notebook 00: the machine and the software stack every GPU number depends on."""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Setup", "The machine and software", "00_environment", "Profile",
            "Which GPUs, driver, CUDA, torch and data produced these numbers?", ("environment",)),
)
