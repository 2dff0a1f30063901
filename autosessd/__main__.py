from .cli import autosessd_main

autosessd_main()
