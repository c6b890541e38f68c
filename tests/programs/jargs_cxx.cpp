// C++ parameters for tests/symbols/test_dwarf.py: `this`, references, a namespace, and
// classes that the psABI passes by invisible reference because they are non-trivial for the
// purpose of calls (a user-provided destructor or copy constructor, of their own or of a
// member). gcc 12 does not emit DW_AT_calling_convention, so the reader must work it out.
namespace geo {
struct pt { int x, y; };
class Shape {
  public:
    int scale(int k, const pt &p, double f);
    int v;
};
int Shape::scale(int k, const pt &p, double f) { return v * k + p.x + (int)f; }
}  // namespace geo

struct Owner { long *p; ~Owner(); };
Owner::~Owner() { *p = 0; }
struct Plain { long a; };
struct Copy { long a; Copy(long x) : a(x) {} Copy(const Copy &o) : a(o.a + 1) {} };
struct Holder { Owner o; };
struct Defaulted {
    long a;
    Defaulted(long x) : a(x) {}
    Defaulted(const Defaulted &) = default;
    ~Defaulted() = default;
};

__attribute__((noinline)) long take(Owner o, Plain q, int k, Copy c, Holder h, Defaulted d,
                                    geo::pt &&r)
{
    return *o.p + q.a + k + c.a + *h.o.p + d.a + r.y;
}

int main()
{
    long x = 1, y = 2;
    geo::Shape s{3};
    geo::pt p{1, 2};
    return s.scale(2, p, 1.0) + (int)take(Owner{&x}, Plain{2}, 3, Copy(4), Holder{Owner{&y}},
                                          Defaulted(5), geo::pt{6, 7});
}
