from flipsync.cli.main import main

main()
