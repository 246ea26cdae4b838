from sandboxq.cli import main

raise SystemExit(main())
