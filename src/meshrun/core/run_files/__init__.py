"""The files ranks leave in a run dir for the driver, which reads them while the ranks train
or after they are gone: one module a kind, its format beside its reader. The ranks' writers
import it from here, so the driver never imports the rank's stack to read them."""
