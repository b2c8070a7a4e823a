from mnesite.cli.main import main

main()
