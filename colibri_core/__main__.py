from colibri_core.cli.main import main

main()
