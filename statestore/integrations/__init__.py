"""Adapters that let other systems use statestore. Each module is optional and installs with its
extra (`statestore[lmcache]` for `statestore.integrations.lmcache`); nothing outside this
package imports them, and the core never imports their third-party dependencies."""
