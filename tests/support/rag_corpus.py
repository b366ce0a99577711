"""A labelled retrieval corpus written for chatkv's tests: 56 short documents and 68 questions.

Each document is one topic with a clear title (fictional product manuals, cooking, astronomy,
Python, gardening, fitness, home repair, hobbies), 80-200 words. Topics overlap on purpose
(a kettle and a dishwasher both fight limescale; sourdough starter and kimchi both ferment; a
grinder and pour-over coffee; an e-bike and a bicycle chain; eyepieces and planets), so the
right answer is not the only document that shares the question's subject.

Each question is labelled with its one right document and was written as a user would ask it,
not copied from the document: paraphrases and synonyms ("limescale" for "mineral deposits",
"how long does the charge last" for "range"), and the product names a user would type.
"""

from __future__ import annotations

from pathlib import Path

DOCUMENTS: dict[str, tuple[str, str]] = {
    # ------------------------------------------------------------ fictional product manuals
    "zephyr-kettle": (
        "Zephyr X200 Electric Kettle: Care and Use",
        """
The Zephyr X200 holds up to 1.7 litres and brings a full jug to a rolling boil in about four minutes.
Fill it between the MIN and MAX marks; running it with too little water trips the dry-boil
protection, and the kettle switches itself off until it has cooled. In areas with hard water,
white mineral deposits build up on the heating plate. Every four weeks, fill the jug halfway with
a solution of one part white vinegar or citric acid to two parts water, boil it, leave it to stand
for an hour, then rinse twice with fresh water. The removable mesh filter in the spout can be
washed under the tap. Keep-warm mode holds the water at 80 degrees for thirty minutes; press the
thermometer button twice to turn it on. Never immerse the base in water.
""",
    ),
    "aurora-grinder": (
        "Aurora K9 Burr Grinder: Settings and Cleaning",
        """
The Aurora K9 uses 40 mm conical steel burrs with 31 numbered settings. Setting 1 is the finest
and suits espresso; settings 10 to 15 give a medium grind for drip brewers; 25 and above make the
coarse, even grounds a French press needs. Change the setting only while the motor runs, so that
beans are not crushed between the burrs. The timer dial doses by seconds: about 1.5 grams a second
at a medium setting. Oily dark roasts leave residue that slows the grinder and makes coffee taste
stale. Once a month, empty the hopper, twist the upper burr out anticlockwise and brush both burrs
and the chute with the supplied brush. Do not wash the burrs with water, and never grind rice
or spices in the K9.
""",
    ),
    "nimbus-vacuum": (
        "Nimbus R5 Robot Vacuum: Mapping and Docking",
        """
On its first run the Nimbus R5 explores every reachable room and builds a floor map with its laser
sensor. The app lets you split the map into rooms, name them and draw no-go lines in front of pet
bowls or loose cables. A full battery gives about 120 minutes of cleaning on the standard suction
level and 70 minutes on max. When the charge drops below 15 percent, the R5 returns to its dock,
recharges, then resumes where it stopped. Place the dock against a wall with half a metre of free
space on each side and two metres in front, away from stairs. Empty the dust bin after every run
and cut hair from the main brush weekly. Replace the HEPA filter every three months.
""",
    ),
    "halcyon-thermostat": (
        "Halcyon T3 Smart Thermostat: Schedules and Eco Mode",
        """
The Halcyon T3 learns when the home is occupied from its motion sensor and the phones paired with
it. Schedules are set per day in the app: up to six temperature periods, each with its own target.
Eco mode lowers the target by three degrees while nobody is home and raises it again twenty
minutes before the first person usually returns. The T3 needs a common wire (C terminal) for power;
without one, use the included power adapter kit rather than drawing power through the heating
wire, which causes the boiler to click on and off. Filter reminders appear after 90 days of
furnace run time. A reading that is two degrees off can be corrected under Settings, Sensor offset.
""",
    ),
    "brightline-ebike": (
        "Brightline Commuter E-Bike: Battery and Assist Levels",
        """
The Brightline Commuter has a 500 Wh battery in the down tube and a 250 W rear hub motor. It offers
four levels of pedal assist: Eco, Tour, Sport and Boost. On Eco a charged battery lasts about 110
kilometres on flat roads; on Boost, closer to 45 kilometres, less in cold weather or on hills. A
full charge from empty takes five hours with the 4 A charger. For long life, store the battery
between 30 and 60 percent charge if the bike will stand unused for weeks, and keep it indoors in
winter. The motor stops helping at 25 km/h, as the law requires in Europe. The walk-assist button
pushes the bike at 6 km/h when you wheel it up a ramp.
""",
    ),
    "corvid-drone": (
        "Corvid Mini 2 Drone: Flight Safety",
        """
The Corvid Mini 2 weighs 249 grams and flies for up to 31 minutes on one battery in calm air. Before
each flight, calibrate the compass if the app asks for it, away from cars and steel structures, and
wait until at least ten GPS satellites are locked so that the home point is recorded. If the radio
link is lost or the battery falls to the critical level, the drone climbs to the return-to-home
altitude, 60 metres by default, and flies back to where it took off. Raise that altitude when
flying near tall trees. Propellers are marked A and B and must go on the motors with the matching
marks. Replace any propeller with a chip or crack. Wind above 38 km/h is beyond what it can handle.
""",
    ),
    "lumen-lamp": (
        "Lumen Arc Desk Lamp: Light Settings",
        """
The Lumen Arc is an LED desk lamp with a touch strip along its arm. Slide a finger along the strip
to dim from 5 to 100 percent; tap the sun icon to cycle the colour temperature through warm
2700 K, neutral 4000 K and cool 6500 K. Warm light is kinder to the eyes late in the evening; cool
light suits detailed work such as soldering or sketching. The night mode, started by holding the
moon icon, glows at 1 percent amber for up to eight hours. A USB-C port in the base charges a phone
at up to 18 W. The lamp remembers its last brightness and colour after being switched off. The
head tilts 90 degrees and the arm rotates 180 degrees.
""",
    ),
    "tidewater-dishwasher": (
        "Tidewater D60 Dishwasher: Cycles and Maintenance",
        """
The Tidewater D60 offers five programmes: Auto, Eco 50, Intensive 70, Glass 45 and a 30 minute Quick
wash for lightly soiled loads. Eco uses the least water and power but runs for almost four hours.
Fill the rinse-aid dispenser when its indicator lights up; rinse aid stops water spots and helps
the dishes dry. The water softener must be set to the hardness of your local supply and its salt
container refilled with dishwasher salt, otherwise limescale leaves a white film on glasses. Clean
the cylindrical filter at the bottom of the tub every week: twist it out, rinse it under the tap and
brush away trapped food. If the dishwasher does not drain, check that filter and the drain hose
for kinks first.
""",
    ),
    # ------------------------------------------------------------ cooking
    "sourdough-starter": (
        "Keeping a Sourdough Starter Alive",
        """
A sourdough starter is a culture of wild yeast and lactic acid bacteria living in flour and water.
Kept on the counter, it needs feeding once or twice a day: discard all but about 50 grams, then add
equal weights of flour and water and stir. A healthy starter doubles in size within four to eight
hours after a feed and smells pleasantly sour, like yoghurt. A layer of grey liquid on top, called
hooch, means it is hungry; pour it off and feed it. If you bake only weekly, keep the jar in the
fridge and feed it once a week. Whole rye flour wakes up a sluggish starter. Pink or orange streaks
mean spoilage: throw it away and begin again.
""",
    ),
    "sourdough-baking": (
        "Baking a Sourdough Loaf",
        """
Mix 500 grams of bread flour with 350 grams of water and leave it for an hour, the autolyse, before
adding 100 grams of active starter and 10 grams of salt. During the bulk fermentation of four to six
hours at room temperature, give the dough four sets of stretch and folds, half an hour apart. Shape
it into a tight ball, place it in a floured banneton, and let it proof overnight in the
refrigerator; the cold slows the yeast and deepens the flavour. Bake in a Dutch oven preheated to
250 degrees: twenty minutes with the lid on, which traps steam so the crust can expand, then twenty
to twenty-five minutes uncovered at 230 degrees until deep brown. Cool it for an hour before slicing.
""",
    ),
    "fresh-pasta": (
        "Making Fresh Egg Pasta by Hand",
        """
For four people, use 400 grams of fine 00 flour and four large eggs. Make a well in the flour, crack
the eggs into it and beat them with a fork, drawing in flour from the walls until a shaggy dough
forms. Knead for eight to ten minutes until smooth and elastic, then wrap it and let it rest for
thirty minutes so the gluten relaxes. Roll it out with a pin or a pasta machine, passing it through
progressively thinner settings, until you can almost see your hand through the sheet. Dust with
semolina and cut into tagliatelle or fill for ravioli. Fresh pasta cooks in two to three minutes in
well salted boiling water; keep a cup of the cooking water to loosen the sauce.
""",
    ),
    "risotto": (
        "Risotto: The Classic Method",
        """
Risotto needs a short-grain rice rich in starch, such as arborio or carnaroli. Soften a finely
chopped onion in butter, then add the rice and stir for two minutes until the grains turn
translucent at the edges; this toasting step is called tostatura. Pour in a glass of dry white wine
and let it evaporate. Add hot stock one ladle at a time, stirring often and waiting until each
ladle is almost absorbed before adding the next. After about eighteen minutes the rice should be
creamy but still slightly firm at the centre. Take the pan off the heat and beat in cold butter and
grated parmesan, the mantecatura, then rest it for two minutes. The finished dish should flow
gently across the plate, all'onda.
""",
    ),
    "knife-sharpening": (
        "Sharpening Kitchen Knives on a Whetstone",
        """
Soak a water stone for ten minutes, until no more bubbles rise, and set it on a damp towel so it
cannot slide. Start on the coarse side, around 1000 grit, holding the blade at 15 to 20 degrees to
the stone; two stacked coins under the spine give roughly the right angle. Push the edge across the
stone in smooth strokes, covering heel to tip, until you can feel a small burr along the opposite
side. Then work the other side the same way. Switch to the fine side, 4000 to 6000 grit, and repeat
with lighter pressure to polish the edge. Finish with a few alternating strokes to remove the burr.
A honing steel between sharpenings only realigns the edge; it does not remove metal.
""",
    ),
    "cast-iron": (
        "Seasoning and Caring for a Cast-Iron Skillet",
        """
Seasoning is a layer of polymerised oil that protects cast iron from rust and makes it naturally
non-stick. To season a pan, scrub it clean, dry it completely on the hob, then wipe a very thin
film of flaxseed or vegetable oil over every surface and buff off the excess until it looks almost
dry. Bake it upside down at 230 degrees for an hour and let it cool in the oven. Repeat three to
five times for a new or stripped pan. After cooking, clean it with hot water and a brush; a little
soap does no harm to good seasoning. Never leave it soaking in the sink. Dry it over heat and rub
in a drop of oil before storing.
""",
    ),
    "kimchi": (
        "Fermenting Napa Cabbage Kimchi",
        """
Cut a napa cabbage into quarters, salt it generously between the leaves and leave it for two hours,
turning it every half hour, until the leaves bend without snapping. Rinse it three times and drain.
Blend garlic, ginger, a little sugar, fish sauce and Korean chilli flakes, gochugaru, into a paste
and add sliced spring onions and julienned radish. Wearing gloves, rub the paste into every leaf.
Pack the cabbage tightly into a jar, pressing out air pockets, and leave a few centimetres of
headspace because the ferment releases gas and brine. Let it ferment at room temperature for one to
two days, until it tastes tangy and bubbles appear, then move it to the fridge, where it keeps
souring slowly for months.
""",
    ),
    "pour-over": (
        "Brewing Pour-Over Coffee",
        """
Pour-over coffee uses a cone dripper and a paper filter. Rinse the filter with hot water to remove
its papery taste and warm the vessel. Use a ratio of about 1 gram of coffee to 16 grams of water:
20 grams of medium-fine ground coffee for 320 grams of water at 92 to 96 degrees. Start with a
bloom: pour twice the coffee's weight of water, enough to wet all the grounds, and wait thirty to
forty-five seconds while trapped carbon dioxide escapes. Then pour slowly in circles, keeping the
water level steady. The whole brew should take about three minutes. If it drains too fast and tastes
sour, grind finer; if it drips slowly and tastes bitter, grind coarser.
""",
    ),
    # ------------------------------------------------------------ astronomy
    "collimation": (
        "Collimating a Newtonian Reflector Telescope",
        """
Collimation is the alignment of a reflecting telescope's mirrors so that they share one optical
axis. A Newtonian that has been transported or bumped is often slightly out of line, which turns
stars at high power into comets or smears. Work with the tube horizontal. Put a collimation cap or
a laser collimator into the focuser. First adjust the three screws of the small secondary mirror
until the laser dot lands in the centre ring marked on the primary mirror. Then turn the primary
mirror's adjustment knobs at the bottom of the tube until the returning beam hits the centre of the
laser's target. Finish with a star test: a slightly defocused star should show even, concentric rings.
""",
    ),
    "eyepieces": (
        "Choosing Telescope Eyepieces",
        """
Magnification equals the telescope's focal length divided by the eyepiece's focal length: a 1200 mm
telescope with a 25 mm eyepiece gives 48 times, and with a 10 mm eyepiece 120 times. Shorter
eyepieces give more power, but also a dimmer, narrower view. The useful maximum is about twice the
aperture in millimetres, so around 300 times for a 150 mm scope, and the atmosphere rarely allows
that. A good set covers low power for star clusters and locating targets, a medium around 100
times, and high power for the Moon and planets. Wide apparent fields of 68 to 82 degrees make
panning more comfortable. A Barlow lens doubles the power of every eyepiece you own.
""",
    ),
    "planets": (
        "Observing the Planets with a Small Telescope",
        """
Even a 70 mm refractor shows the four large moons of Jupiter as points of light that change position
from night to night, along with two dark cloud belts across the disc. Saturn's rings are visible at
around 30 times, and a steady night at higher power reveals the Cassini division, a dark gap in the
rings. Venus shows phases like a small Moon. Mars is small and disappointing except near opposition,
roughly every 26 months, when its polar cap and dark markings appear. Planets look best when they
stand high in the sky, away from the turbulent air near the horizon. Let the telescope cool outside
for half an hour, and wait for moments of steady seeing.
""",
    ),
    "meteor-showers": (
        "Watching Meteor Showers",
        """
A meteor shower happens when Earth passes through a stream of dust left behind by a comet. The
Perseids peak around 12 August and can bring 60 or more meteors an hour under dark skies; the
Geminids in mid-December are often richer still. Meteors seem to come from one point in the sky,
the radiant, but they appear all over, so no telescope or binoculars are needed: lie back on a
reclining chair and take in as much sky as possible. The hours before dawn are usually best,
because your side of the Earth then faces forward into the stream. Give your eyes twenty minutes to
adapt to the dark and avoid looking at your phone. A bright Moon washes out fainter meteors.
""",
    ),
    "lunar-eclipse": (
        "Lunar Eclipses Explained",
        """
A lunar eclipse happens when the Earth lies directly between the Sun and a full Moon and its shadow
falls on the Moon. In a total eclipse the Moon enters the dark inner shadow, the umbra, and
usually turns coppery red rather than disappearing: sunlight bent through Earth's atmosphere reaches
it, filtered red for the same reason sunsets are red. Totality can last over an hour and a half.
Unlike a solar eclipse, a lunar eclipse is safe to watch with the naked eye and can be seen from
the whole night side of the Earth at once. Eclipses do not happen every month because the Moon's
orbit is tilted about five degrees to Earth's.
""",
    ),
    "light-pollution": (
        "Light Pollution and the Bortle Scale",
        """
The Bortle scale rates how dark a night sky is, from class 1, an excellent dark site where the
Milky Way casts shadows, to class 9, an inner-city sky where only the brightest stars and planets
show. Most suburbs sit around class 5 or 6, where the Milky Way is faint or invisible. Artificial
light scattered by the atmosphere creates the glow that hides faint galaxies and nebulae. Narrowband
and light-pollution filters help with emission nebulae but not with galaxies or star clusters.
The best remedy is distance: driving an hour away from a city can improve the sky by several
classes. Online light-pollution maps show darker areas near you, and new-Moon weekends are the
darkest times to go.
""",
    ),
    # ------------------------------------------------------------ Python
    "py-decorators": (
        "Python Decorators",
        """
A decorator is a callable that takes a function and returns a replacement for it. Writing
@timer above def load() is shorthand for load = timer(load). Inside, a decorator usually defines a
wrapper function that accepts *args and **kwargs, does some work before or after calling the
original, and returns its result. Apply functools.wraps to the wrapper so that the decorated
function keeps its name, docstring and signature for debuggers and help(). A decorator that takes
arguments, such as @retry(times=3), is a function that returns the actual decorator, so it has
three levels of nesting. Several decorators stack, applied from the bottom up. Common built-in
examples are property, staticmethod, classmethod and functools.lru_cache.
""",
    ),
    "py-generators": (
        "Python Generators and yield",
        """
A function containing yield is a generator function: calling it returns a generator object
without running the body. Each call to next() runs the code up to the next yield and hands out that
value, keeping local variables alive between calls; when the function returns, StopIteration ends
the loop. Because values are produced one at a time, a generator can walk a file of many gigabytes
or an endless sequence while using very little memory. Generator expressions, written like a list
comprehension in round brackets, build one inline. The statement yield from delegates to another
iterable. A generator can only be consumed once; to go over the values again you need a new one,
or a list.
""",
    ),
    "py-context-managers": (
        "Python Context Managers and the with Statement",
        """
The with statement guarantees that set-up and clean-up code run around a block, even when the block
raises an exception. Opening a file with with open(path) as f closes the file when the block ends.
Any object with __enter__ and __exit__ methods works: __enter__ returns the value bound by as,
and __exit__ receives the exception type, value and traceback, and may suppress the exception by
returning True. The contextlib module makes simple ones easy: decorate a generator with
@contextmanager, put the set-up before a single yield and the clean-up in a finally block after it.
contextlib.ExitStack manages a variable number of resources, and suppress() ignores chosen
exceptions. Locks, database transactions and temporary directories are typical uses.
""",
    ),
    "py-comprehensions": (
        "Python List, Dict and Set Comprehensions",
        """
A list comprehension builds a list from an iterable in one expression: [x * x for x in range(10)]
gives the first ten squares. An if clause at the end keeps only some items, as in
[n for n in numbers if n % 2 == 0]. A conditional expression before the for transforms items
instead: ["even" if n % 2 == 0 else "odd" for n in numbers]. Several for clauses nest, left to
right, which flattens a list of lists. Curly brackets make a set comprehension, and key: value pairs
make a dict comprehension such as {name: len(name) for name in names}. Comprehensions are usually
faster and clearer than an equivalent loop with append, but a deeply nested one is better written
as an ordinary loop.
""",
    ),
    "py-dataclasses": (
        "Python Dataclasses",
        """
The @dataclass decorator from the dataclasses module writes the boring parts of a class for you:
from annotated class attributes it generates __init__, __repr__ and __eq__. Give a field a default
value with an ordinary assignment; for mutable defaults such as lists use field(default_factory=list),
since a shared list would leak between instances. frozen=True makes instances immutable and
hashable, and order=True adds comparison methods. Post-initialisation checks go in __post_init__.
slots=True, from Python 3.10, saves memory and speeds up attribute access. asdict() turns an
instance into a plain dictionary, and replace() returns a copy with some fields changed. For
validation of external input, libraries such as pydantic go further.
""",
    ),
    "py-asyncio": (
        "Python asyncio Basics",
        """
asyncio runs many tasks concurrently on one thread, switching between them whenever one waits for
input or output. A coroutine is defined with async def and paused with await at points where it
waits, for example on a network response or asyncio.sleep(). asyncio.run(main()) starts the event
loop and runs a top-level coroutine. asyncio.gather() runs several coroutines concurrently and
collects their results; asyncio.create_task() schedules one to run in the background. A task
group, from Python 3.11, cancels its other tasks when one fails. Blocking calls such as time.sleep
or a heavy computation freeze the whole loop; move them to a thread with asyncio.to_thread().
asyncio suits programs that spend their time waiting on sockets, not number crunching.
""",
    ),
    "py-typing": (
        "Python Type Hints",
        """
Type hints annotate what a function expects and returns, as in def greet(name: str) -> str. Python
itself ignores them at run time; tools such as mypy and pyright read them to find bugs before the
program runs, and editors use them for completion. Built-in collections can be parametrised
directly: list[int], dict[str, float]. Write int | None, or Optional[int], for a value that may be
missing. TypedDict describes dictionaries with fixed keys, Protocol describes structural interfaces
that any class with the right methods satisfies, and TypeVar makes functions generic. Under
from __future__ import annotations, annotations are stored as strings and never evaluated, which
allows forward references. Gradual typing means you can add hints one module at a time.
""",
    ),
    "py-venv": (
        "Python Virtual Environments",
        """
A virtual environment is a folder holding its own Python interpreter link and its own
site-packages, so each project can install the package versions it needs without touching other
projects or the system Python. Create one with python -m venv .venv in the project folder. Activate
it with source .venv/bin/activate on Linux and macOS, or .venv\\Scripts\\activate on Windows; the
prompt then shows its name, and pip installs into it. deactivate leaves it. Record dependencies in
a requirements.txt file or in pyproject.toml so others can recreate the environment. Never commit
the environment folder itself to version control; it is large and tied to your machine's paths. If
it breaks, delete it and build it again.
""",
    ),
    # ------------------------------------------------------------ gardening
    "composting": (
        "Home Composting",
        """
A compost heap turns kitchen and garden waste into dark, crumbly soil improver. Balance green
materials, which are rich in nitrogen, such as vegetable peelings, coffee grounds and grass
clippings, with brown materials rich in carbon, such as dry leaves, straw and shredded cardboard,
roughly one part green to two or three parts brown by volume. Keep the heap as damp as a wrung-out
sponge and turn it every couple of weeks to let air in; a well-managed heap gets warm in the
middle. A heap that smells of rotten eggs or ammonia is too wet or has too much green material:
add browns and turn it. Leave out meat, dairy and cooked food, which attract rats. Compost is ready
in six months to a year.
""",
    ),
    "tomatoes": (
        "Growing Tomatoes",
        """
Tomatoes need at least six to eight hours of direct sun and warm nights above 10 degrees, so plant
them out only after the last frost. Bury the stems deeper than they stood in the pot; roots form
along the buried part. Cordon, or indeterminate, varieties grow tall and need a stake; pinch out
the side shoots, called suckers, that appear where a leaf meets the main stem, so the plant puts
its energy into fruit. Bush varieties need no pinching. Water deeply and regularly at the base:
irregular watering causes blossom end rot, a dark sunken patch on the bottom of the fruit, and
splitting. Feed with a high-potassium fertiliser once the first flowers set. Remove leaves below
the first truss to reduce blight.
""",
    ),
    "fruit-trees": (
        "Pruning Apple and Pear Trees",
        """
Prune apple and pear trees in winter, while they are dormant, between leaf fall and late winter.
Start by removing the three Ds: dead, diseased and damaged wood. Then cut out branches that cross
or rub against each other and those growing into the centre, aiming for an open goblet shape that
lets light and air reach the middle of the tree. Shorten the leading shoots of the main branches by
about a third, cutting just above an outward-facing bud. Do not remove more than a quarter of the
canopy in one year; hard pruning provokes a mass of vigorous upright shoots, called water sprouts,
instead of fruit. Use clean, sharp secateurs and a pruning saw, and make cuts at a slight angle.
Plums and cherries are pruned in summer instead.
""",
    ),
    "houseplants": (
        "Watering Houseplants",
        """
More houseplants die from too much water than from too little. Roots need air as well as water,
and soil that stays wet suffocates them and invites root rot, which shows as yellowing lower
leaves, a soft stem base and soil that smells sour. Before watering, push a finger two centimetres
into the compost: water only if it feels dry at that depth. Water thoroughly until it runs out of
the drainage holes, then empty the saucer after half an hour. Pots without drainage holes are the
most common cause of trouble. Most plants need far less water in winter, when growth slows.
Succulents and cacti prefer to dry out completely between waterings, while ferns like to stay
evenly moist.
""",
    ),
    # ------------------------------------------------------------ fitness and health
    "marathon": (
        "Training for a First Marathon",
        """
Most first-time marathon plans run for sixteen to twenty weeks and build from around 30 kilometres a
week to a peak of 55 to 70. The key session is the weekly long run, which grows gradually to about
32 kilometres, run at an easy pace where you could still talk. Increase total weekly distance by no
more than about ten percent, and make every fourth week lighter to let the body adapt. Practise
eating and drinking during long runs, with the same gels and drinks you will use on race day. In
the last three weeks, taper: cut weekly volume by roughly a quarter, then half, while keeping some
short faster efforts, so that you start the race rested. Start the race slower than you think.
""",
    ),
    "sleep": (
        "Better Sleep Habits",
        """
Adults need seven to nine hours of sleep. Going to bed and getting up at the same times every day,
weekends included, steadies the body clock more than anything else. Morning daylight helps set the
clock; bright screens late in the evening delay it. Keep the bedroom dark, quiet and cool, around
18 degrees. Caffeine has a half-life of about five hours, so an afternoon coffee can still be
keeping you awake at midnight; alcohol makes you drowsy but breaks up sleep later in the night. If
you lie awake for more than twenty minutes, get up and do something calm in dim light until you
feel sleepy, rather than lying in bed worrying. Long naps late in the day make it harder to fall
asleep.
""",
    ),
    "stretching": (
        "Warming Up and Stretching",
        """
A warm-up raises muscle temperature and heart rate before exercise. Five to ten minutes of easy
jogging, cycling or skipping, followed by dynamic stretches such as leg swings, walking lunges and
arm circles, prepares the body better than holding static stretches, which can briefly reduce power
if done just before sprinting or lifting. Save static stretching, holding each position for twenty
to thirty seconds without bouncing, for after training or a separate session; it is the part that
improves flexibility over weeks. Stretch to mild tension, never to pain. Regular stretching of the
hip flexors and hamstrings helps people who sit all day. Cooling down with a few minutes of easy
movement lets the heart rate come down gradually.
""",
    ),
    # ------------------------------------------------------------ home and hobbies
    "leaky-faucet": (
        "Fixing a Dripping Tap",
        """
A tap that keeps dripping after being turned off usually has a worn washer or cartridge. First shut
off the water at the isolation valve under the sink, or at the main stopcock, and open the tap to
drain what remains. Put the plug in so small parts cannot fall down the drain. Prise off the
decorative cap, undo the screw beneath it and remove the handle. For a traditional tap, unscrew the
headgear nut with a spanner and replace the rubber washer at its base. Modern mixer taps use a
ceramic disc cartridge instead, which is swapped as a whole; take the old one to the shop to match
it. Reassemble, turn the water back on slowly and check for leaks.
""",
    ),
    "painting-walls": (
        "Painting Interior Walls",
        """
Good preparation decides how the finished wall looks. Move furniture to the middle of the room and
cover it and the floor with dust sheets. Fill cracks and holes with filler, let it dry and sand it
smooth, then wash the walls with a mild sugar-soap solution so the paint adheres. Protect skirting
boards, switches and window frames with masking tape. Cut in first: paint a five centimetre band
along the edges and corners with a brush. Then fill the rest with a roller, working in overlapping
W shapes and keeping a wet edge so that no lap marks show. New plaster needs a mist coat of diluted
paint first. Most walls need two coats, four hours apart.
""",
    ),
    "bike-chain": (
        "Cleaning and Lubricating a Bicycle Chain",
        """
A dirty, dry chain wears out the cassette and chainrings quickly and makes shifting sluggish. Every
few hundred kilometres, or after a wet ride, clean it: run the chain through a rag soaked in
degreaser while turning the pedals backwards, or use a chain-cleaning box. Scrub the jockey wheels
and chainrings with a brush. Let everything dry, then put one drop of lubricant on each roller,
turn the pedals for a minute and wipe off the excess from the outside, because oil left on the
outer plates only collects grit. Wet lube suits rain and mud; dry lube suits dusty summer roads.
Measure wear with a chain checker and replace the chain at 0.5 percent stretch on 11 or 12 speed.
""",
    ),
    "exposure-triangle": (
        "Photography: The Exposure Triangle",
        """
Three settings control how bright a photograph comes out. Aperture, written as an f-number, is the
size of the lens opening: f/1.8 lets in far more light than f/16 and also gives a shallow depth of
field with a blurred background, useful for portraits. Shutter speed is how long the sensor is
exposed: 1/1000 of a second freezes a running dog, while half a second blurs moving water and needs
a tripod. ISO sets the sensor's sensitivity; raising it from 100 to 3200 brightens a dim scene but
adds grain, called noise. Changing one setting by a stop must be balanced by another to keep the
same exposure. Start in aperture priority mode and watch the shutter speed the camera picks.
""",
    ),
    "bird-migration": (
        "How Birds Navigate on Migration",
        """
Many birds travel thousands of kilometres between breeding and wintering grounds each year; the
Arctic tern flies from pole to pole and back. They find their way with several compasses at once.
Young birds inherit a direction and a distance to fly. By day they use the position of the Sun,
corrected for the time of day by their internal clock; night migrants read the rotation of the
stars around the celestial pole, which they learn as nestlings. Birds also sense the Earth's
magnetic field, probably through light-sensitive proteins in their eyes. Near the end of the
journey, landmarks such as coastlines and mountain ranges and even smells guide them home. Strong
winds can blow migrants far off course.
""",
    ),
    "beekeeping": (
        "Inspecting a Beehive",
        """
Inspect a hive about once a week in the active season, on a warm, calm day around midday, when many
foragers are out. Wear a veil and gloves, and puff a little cool smoke into the entrance, then
under the lid, and wait a minute; smoke masks the alarm pheromone and calms the bees. Lift frames
out slowly, one at a time, holding them over the box. Look for eggs, which prove the queen was
laying in the last three days, for capped brood in a compact pattern, and for stores of honey and
pollen. Queen cells hanging from the bottom of frames mean the colony is preparing to swarm. Note
what you find, close the hive gently and avoid crushing bees between the boxes.
""",
    ),
    "git-branches": (
        "Git Branches and Merging",
        """
A Git branch is a movable pointer to a commit, so creating one is instant and cheap. git switch -c
feature creates a branch and moves to it; commits made there leave main untouched. To bring the
work back, switch to main and run git merge feature: if main has not moved, Git simply fast-forwards
the pointer, otherwise it creates a merge commit with two parents. When both branches changed the
same lines, Git stops with a conflict; edit the files to resolve the markers, then git add them and
commit. Rebasing, with git rebase main, replays your commits on top of the latest main for a linear
history, but never rebase commits that others have already pulled. git branch -d removes a
merged branch.
""",
    ),
    "wine-storage": (
        "Storing Wine at Home",
        """
Wine ages best in a dark place at a steady 10 to 15 degrees. Temperature swings matter more than the
exact figure: repeated warming and cooling pushes wine past the cork and lets oxygen in. Lay bottles
with natural corks on their sides so the cork stays moist and does not shrink; screw-capped bottles
can stand. Keep humidity around 60 to 70 percent, away from vibration and strong smells. A kitchen
is usually too warm and changeable, and the top of the fridge is the worst place of all. Most
everyday wines are made to be drunk within two or three years; only a small share improves with a
decade in the cellar. Once opened, recork and refrigerate; most reds keep three to five days.
""",
    ),
    "first-aid-burns": (
        "First Aid for Minor Burns",
        """
Cool a burn under cool or lukewarm running water for twenty minutes as soon as possible; it still
helps if started within three hours. Do not use ice, iced water, butter or creams, which can damage
the skin further. Remove rings, watches and clothing near the burn before swelling starts, but
leave anything stuck to the skin. After cooling, cover the burn loosely with cling film laid in a
layer rather than wrapped around a limb, or a clean plastic bag for a hand. Do not burst blisters.
Paracetamol or ibuprofen eases the pain. Seek medical help for burns larger than the casualty's
hand, burns on the face, hands, feet or genitals, all chemical and electrical burns, and any burn
on a young child.
""",
    ),
    # ------------------------------------------------------------ product families: near neighbours
    "zephyr-x350": (
        "Zephyr X350 Glass Kettle: Temperature Presets",
        """
The Zephyr X350 is a 1.5 litre borosilicate glass kettle with four temperature presets: 70 degrees
for green tea, 80 for white tea, 90 for oolong and coffee, and a full 100 degree boil for black tea.
Press the preset button until the matching light shows, then press start; the blue ring turns off
when the water has reached the temperature. The hold function keeps the chosen temperature for up
to sixty minutes. Because the glass shows every trace of scale, descale every six weeks using
citric acid only: vinegar can cloud the seal around the glass. Dissolve two tablespoons in a litre
of water, heat it to 90, leave it for twenty minutes and rinse. The base plays a short tone when
the water is ready; hold the start button for three seconds to silence it.
""",
    ),
    "halvard-travel-kettle": (
        "Halvard Travel Kettle: Using It Abroad",
        """
The Halvard travel kettle folds its handle flat and holds 0.5 litres, enough for two cups. It works
on both 110 to 120 volt and 220 to 240 volt mains: move the voltage selector on the base with a coin
before plugging it in, because running it on the wrong setting can burn out the element. A plug
adapter is still needed in many countries; the kettle includes none. Two cups boil in about three
minutes on 230 volts and six minutes on 120 volts. The two plastic cups and the cable pack inside
the kettle for transport. Let it dry with the lid open before packing it to avoid stale smells.
Descale it with a sachet of citric acid when white flakes appear.
""",
    ),
    "nimbus-errors": (
        "Nimbus R5 Robot Vacuum: Error Codes",
        """
When the Nimbus R5 stops with its ring light flashing red, the app shows a code. E1: a side wheel is
stuck or lifted; check the wheel for hair and put the robot on a flat floor. E2: the bumper is
jammed; tap it gently all round until it moves freely. E3: the cliff sensors on the underside are
dirty; wipe them with a dry cloth. E4: the main brush is tangled; remove the brush guard and cut
away hair or string. E5: the dust bin or filter is missing or not seated. E6: the battery is too
hot or too cold; let the robot reach room temperature. E7: the laser sensor on top is blocked or
its cover is pressed down. E8: the robot cannot find its dock; carry it back and restart the map.
""",
    ),
    "nimbus-r7": (
        "Nimbus R7 Mopping Robot",
        """
The Nimbus R7 adds a mopping pad and a 250 millilitre water tank to the vacuum of the R5. Fill the
tank with cold water only; detergents and hot water damage the pump and void the warranty. The app
sets the water flow to low, medium or high, and carpet detection lifts the pad by seven millimetres
when the robot rolls onto a rug, so carpets stay dry. For thick rugs, mark them as no-mop zones.
Wash the microfibre pad after every mopping run, at up to 60 degrees, and let it dry before the next
one. Mopping shortens the run time to about 90 minutes. Remove the tank before the robot returns to
a dock placed on wooden flooring, to avoid drips.
""",
    ),
    "corvid-pro": (
        "Corvid Pro 4 Drone: Registration and Obstacle Sensing",
        """
The Corvid Pro 4 weighs 895 grams, so unlike lighter models it must be registered with the aviation
authority in most countries, and its pilot needs an online competency certificate before flying.
Its omnidirectional obstacle sensors stop or steer the drone around trees and buildings; they do
not work at night or in heavy rain, and they are switched off in Sport mode. A battery gives about
46 minutes of hover time. The 4/3 inch camera records 5.1K video, and a three-axis gimbal keeps it
level. Keep the firmware of the drone, batteries and controller on the same version, or the app
refuses to take off. Store batteries at about 60 percent charge; they discharge to that level by
themselves after ten days.
""",
    ),
    "halcyon-wiring": (
        "Halcyon T3: Wiring Terminals",
        """
Turn off power to the heating system at the breaker before removing an old thermostat, and take a
photo of its wiring. The Halcyon T3 base has these terminals. R or Rh: 24 volt power from the
transformer, usually a red wire. C: the common wire, often blue, which completes the circuit so
the thermostat can run continuously. W or W1: heat call to the furnace or boiler, usually white.
Y or Y1: cooling, to the air-conditioning compressor, usually yellow. G: the blower fan, usually
green. O/B: the reversing valve on a heat pump. Push each stripped wire fully into its terminal
until the release tab clicks. The T3 must not be connected to 120 or 240 volt line-voltage heaters,
such as electric baseboards.
""",
    ),
    "aurora-k5": (
        "Aurora K5 Blade Grinder: Quick Start",
        """
The Aurora K5 is an inexpensive blade grinder: a spinning steel blade chops beans rather than
milling them between burrs, so the particle size is less even than with the K9. Fill the bowl no
higher than the line, about 60 grams, put the lid on and press down to start; release it to stop.
For drip coffee, grind in short pulses for ten to twelve seconds, shaking the grinder between
pulses; for a French press, six to eight seconds. The K5 cannot grind fine enough for espresso.
Unlike burr models, it also grinds spices and dried herbs; wipe the bowl with a damp cloth and
grind a spoonful of rice afterwards to remove the smell before using it for coffee again.
""",
    ),
    "py-functools": (
        "Python functools: Caching and Partial Functions",
        """
functools.lru_cache memoises a function: it stores results keyed by the arguments, so a repeated call
returns instantly instead of recomputing. maxsize limits how many results are kept, dropping the
least recently used; functools.cache, from Python 3.9, keeps all of them. The arguments must be
hashable, and cached methods keep their instances alive. cache_info() reports hits and misses and
cache_clear() empties it. functools.partial freezes some arguments of a function and returns a new
callable, handy for callbacks: partial(int, base=2) parses binary strings. functools.reduce folds a
sequence to one value with a two-argument function. singledispatch chooses an implementation by
the type of the first argument, and total_ordering fills in comparison methods from __eq__ and one other.
""",
    ),
    "py-itertools": (
        "Python itertools: Building Blocks for Iteration",
        """
The itertools module holds fast, memory-efficient tools that produce iterators. chain() walks
several iterables one after another, and chain.from_iterable() flattens one level of nesting.
islice() takes a slice of any iterator, even an infinite one such as count(). groupby() collects
consecutive items with the same key, so sort the data by that key first or equal keys will appear in
separate groups. product() gives the Cartesian product, replacing nested loops; permutations() and
combinations() give orderings and selections. accumulate() yields running totals. tee() splits one
iterator into several independent ones. batched(), new in Python 3.12, cuts an iterable into tuples
of a given length, and pairwise() yields overlapping pairs of neighbours.
""",
    ),
    "py-pathlib": (
        "Python pathlib: Working with File Paths",
        """
pathlib represents file-system paths as objects instead of strings. Path.home() / "notes" / "todo.txt"
joins parts with the division operator, using the right separator on every operating system. A path
knows its pieces: .name is the file name, .stem the name without its suffix, .suffix the extension
and .parent the containing folder. read_text() and write_text() read or write a whole file in one
call, and exists(), is_file() and is_dir() test what is there. glob("*.csv") lists matching files in
a folder and rglob() searches subfolders too. mkdir(parents=True, exist_ok=True) creates a folder and
any missing parents without failing if it already exists. resolve() gives the absolute path with
symbolic links followed.
""",
    ),
}

# (question, the id of its one right document)
QUESTIONS: list[tuple[str, str]] = [
    ("How do I get rid of limescale in my Zephyr kettle?", "zephyr-kettle"),
    ("why did my kettle turn itself off when it was nearly empty", "zephyr-kettle"),
    ("Which number should I pick on the Aurora K9 for a cafetière?", "aurora-grinder"),
    ("how do I clean the burrs of my grinder without water", "aurora-grinder"),
    ("How long does the Nimbus R5 run before it needs to recharge?", "nimbus-vacuum"),
    ("Can I stop the robot from going near my dog's food dish?", "nimbus-vacuum"),
    ("My boiler keeps clicking on and off since I installed the Halcyon T3; why?", "halcyon-thermostat"),
    ("What does the thermostat do when the house is empty?", "halcyon-thermostat"),
    ("How far can I ride the Brightline before the battery runs out?", "brightline-ebike"),
    ("best way to keep an e-bike battery healthy over the winter", "brightline-ebike"),
    ("What happens if my Corvid drone loses its connection to the controller?", "corvid-drone"),
    ("Which propeller goes on which motor?", "corvid-drone"),
    ("Which light colour on the Lumen Arc is easiest on the eyes at night?", "lumen-lamp"),
    ("Why are my glasses coming out of the dishwasher cloudy?", "tidewater-dishwasher"),
    ("the dishwasher leaves water standing at the bottom, what should I check", "tidewater-dishwasher"),
    ("There's a dark liquid sitting on top of my starter, is it ruined?", "sourdough-starter"),
    ("How often do I need to feed a levain kept in the refrigerator?", "sourdough-starter"),
    ("Why should the loaf go into a lidded pot for the first part of baking?", "sourdough-baking"),
    ("how long should bread dough rise at room temperature before shaping", "sourdough-baking"),
    ("How thin do I roll homemade noodle dough?", "fresh-pasta"),
    ("Which rice works for a creamy Italian rice dish and how long does it cook?", "risotto"),
    ("What angle should I hold a chef's knife at on a sharpening stone?", "knife-sharpening"),
    ("Is it okay to use dish soap on my cast iron pan?", "cast-iron"),
    ("why does my kimchi jar need empty space at the top", "kimchi"),
    ("How much ground coffee per cup for a V60-style dripper, and why does it taste sour?", "pour-over"),
    ("Stars look like little comets in my Newtonian, how do I fix it?", "collimation"),
    ("How do I work out the magnification I get from an eyepiece?", "eyepieces"),
    ("Can a beginner telescope show the gap in Saturn's rings?", "planets"),
    ("What's the best time of night to see shooting stars in August?", "meteor-showers"),
    ("Why does the moon look red during an eclipse?", "lunar-eclipse"),
    ("How dark is the sky in a typical suburb and how can I find a darker place?", "light-pollution"),
    ("How do I keep the original function's name when I wrap it?", "py-decorators"),
    ("How can I make a decorator that accepts parameters?", "py-decorators"),
    ("process a huge file lazily one item at a time in Python", "py-generators"),
    ("How do I write my own object that works with the with keyword?", "py-context-managers"),
    ("one-line way to build a dictionary mapping each word to its length", "py-comprehensions"),
    ("Why can't I use an empty list as a default for a dataclass field?", "py-dataclasses"),
    ("my async program freezes when I call time.sleep, what should I use", "py-asyncio"),
    ("How do I annotate an argument that might be None?", "py-typing"),
    ("How do I keep each project's pip packages separate from the others?", "py-venv"),
    ("My compost heap stinks, what am I doing wrong?", "composting"),
    ("Should I remove the little shoots growing between the stem and branches of my tomato?", "tomatoes"),
    ("When is the right season to cut back an apple tree?", "fruit-trees"),
    ("yellow leaves and mushy stem on my potted plant", "houseplants"),
    ("How much should I cut back my running mileage before race day?", "marathon"),
    ("I can't fall asleep at night, does my afternoon espresso matter?", "sleep"),
    ("Should I hold static stretches before sprinting?", "stretching"),
    ("How do I replace the washer in a dripping kitchen tap?", "leaky-faucet"),
    ("how to avoid visible roller stripes when decorating a room", "painting-walls"),
    ("How often should I oil my bike's drivetrain, and which lube for wet weather?", "bike-chain"),
    ("Which camera setting gives a portrait a blurry background?", "exposure-triangle"),
    ("How do songbirds that fly at night know which way to go?", "bird-migration"),
    ("What does it mean if I find queen cups at the bottom of the frames?", "beekeeping"),
    ("How do I combine my feature work back into main in git?", "git-branches"),
    ("Is the kitchen a good place to keep a few bottles of red?", "wine-storage"),
    ("Should I put ice on a scald from boiling water?", "first-aid-burns"),
    ("Can I use vinegar to descale the X350?", "zephyr-x350"),
    ("What temperature should I set the Zephyr to for green tea?", "zephyr-x350"),
    ("Will the Halvard work on American power outlets?", "halvard-travel-kettle"),
    ("The Nimbus stopped and the app says E4", "nimbus-errors"),
    ("what does error E3 on my robot vacuum mean", "nimbus-errors"),
    ("Can I add floor cleaner to the R7's water tank?", "nimbus-r7"),
    ("Do I have to register the Corvid Pro 4 before flying it?", "corvid-pro"),
    ("Which wire goes to the Y terminal on the T3?", "halcyon-wiring"),
    ("Is the Aurora K5 fine enough for an espresso machine?", "aurora-k5"),
    ("How do I memoize an expensive function so repeated calls are fast?", "py-functools"),
    ("Why does itertools.groupby split my equal keys into several groups?", "py-itertools"),
    ("How do I find every CSV file in a folder and its subfolders with pathlib?", "py-pathlib"),
]


def write_corpus(folder: Path) -> dict[str, Path]:
    """Write every document as ``<id>.md`` (its title as a "# " heading) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for doc_id, (title, body) in DOCUMENTS.items():
        path = folder / f"{doc_id}.md"
        path.write_text(f"# {title}\n\n{' '.join(body.split())}\n", encoding="utf-8")
        files[doc_id] = path
    return files
