"""What every floor stands on: errors, the generic registry, what a person sees (logging and progress), files
written whole or not at all, the data roots a path must stay inside, image sizes and YAML.  Nothing here knows a
recipe, a stage or a task."""
