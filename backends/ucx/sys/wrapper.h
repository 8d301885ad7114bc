/* The one header kvxfer-ucx-sys binds. */
#include <ucp/api/ucp.h>
