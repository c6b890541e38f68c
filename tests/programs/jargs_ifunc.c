/* An IFUNC: the symbol add3's value is the resolver, a function of no parameters with DWARF
 * of its own; the DWARF reader must not offer the resolver's signature for add3. */
static long add3_generic(long a, long b, long c)
{
    return a + b + c;
}

static long (*resolve_add3(void))(long, long, long)
{
    return add3_generic;
}

long add3(long a, long b, long c) __attribute__((ifunc("resolve_add3")));

int main(void)
{
    return (int)add3(1, 2, 3) - 6;
}
