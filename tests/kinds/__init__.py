"""Draft kinds that live in the test suite only: each folder is a kind as `draft_opd_ray/drafts/<kind>/` is."""
