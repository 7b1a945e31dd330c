"""Offline encoding and missing modalities: a module's entry point (`encoder`), its cache (`cache`), serving rows
from caches (`serve`), and ranks whose batch lacks a module's input (`missing_modality`)."""
