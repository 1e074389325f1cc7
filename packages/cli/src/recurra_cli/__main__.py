from recurra_cli.main import main

main()
