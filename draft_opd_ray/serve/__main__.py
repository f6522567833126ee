"""`python -m draft_opd_ray.serve [key=value ...]`: the same config tree, overrides and checks as
`draft_opd_ray.main`, plus `serve.*`; then vLLM's OpenAI server whose draft learns from its traffic."""

from draft_opd_ray.main import Entry, main
from draft_opd_ray.serve.server import check, describe, serve, stopped

if __name__ == "__main__":
    main(entry=Entry(check, describe, serve, stopped))
